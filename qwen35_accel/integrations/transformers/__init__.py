"""Transformers' side of the plugin (the Trainer, `from_pretrained`'s sharding): its patch points
(`trainer_points.py`) and their wrappers."""
