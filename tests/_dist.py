"""Multi-process tests: `run_world(fn, world_size, *args)` runs `fn` on a CPU gloo world.

Workers are module-level functions `fn(rank, world_size, *args)`; an exception in any
rank fails the test with that rank's traceback. Worlds are pooled (one per size, kept
between tests: `qwen35_accel.testing.world_pool`); `QWEN35_TESTING_FRESH_WORLDS=1` spawns
one per test.
"""

from __future__ import annotations

import os

from qwen35_accel.testing.world_pool import run_pooled_world

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # inherited by the spawned ranks


def run_world(fn, world_size: int, *args) -> None:
    run_pooled_world(fn, world_size, *args, threads_per_rank=1)
