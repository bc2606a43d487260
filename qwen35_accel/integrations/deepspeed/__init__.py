"""DeepSpeed's side of the plugin: its patch points (`deepspeed_points.py`) and their wrappers, and the
GatedDeltaNet gates kept out of DeepSpeed's engine (`gates.py`). DeepSpeed is optional: nothing here
imports it at module level."""
