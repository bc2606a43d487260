"""The Accelerate/Trainer integration (the plugin): see `accelerate.py` for the map of its modules."""
