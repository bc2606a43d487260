"""Run a function on a gloo world of CPU processes (spawned), for multi-process tests.

Workers are module-level functions `fn(rank, world_size, *args)`; an exception in any
rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_world(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Spawn `world_size` ranks running `fn(rank, world_size, *args)`; re-raise failures."""
    mp.start_processes(_entry, args=(fn, world_size, _free_port(), args), nprocs=world_size, start_method="spawn")
