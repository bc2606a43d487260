"""Multi-process tests: `run_world(fn, world_size, *args)` runs `fn` on a CPU gloo world.

Workers are module-level functions `fn(rank, world_size, *args)`; an exception in any
rank fails the test with that rank's traceback. Each call is a fresh world whose ranks are forked
from one server process that imported torch, Transformers and this package once
(`qwen35_accel.local_world`, start method "forkserver"): a world starts in under a second, and no
rank outlives its test.
"""

from __future__ import annotations

import os

from qwen35_accel.local_world import run_local_world

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # inherited by the ranks


def run_world(fn, world_size: int, *args) -> None:
    run_local_world(fn, world_size, *args, threads_per_rank=1, start="forkserver")
