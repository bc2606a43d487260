"""Accelerate's side of the plugin: its patch points (`accelerate_points.py`) and their wrappers."""
