"""Multi-process tests: `run_world(fn, world_size, *args)` spawns a CPU gloo world.

Workers are module-level functions `fn(rank, world_size, *args)`; an exception in any
rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import os

from qwen35_accel.testing.local_world import run_local_world

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # inherited by the spawned ranks


def run_world(fn, world_size: int, *args) -> None:
    run_local_world(fn, world_size, *args, threads_per_rank=1)
