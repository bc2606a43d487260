"""The Accelerate/Trainer/TRL integration (the plugin), by upstream: see `plugin.py` for the map."""
