"""TRL's side of the plugin: its patch points (`trl_points.py`) and their wrappers. TRL is optional: nothing
here imports it at module level."""
