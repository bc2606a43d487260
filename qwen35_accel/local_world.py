"""Run a function on a local world of CPU processes over gloo (demo, tests, benchmarks).

Real jobs are launched by `accelerate launch` / `torchrun`; this is for one machine
without accelerators, where spawning N processes is the whole point.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., None], world_size: int, port: int, threads: int, args: tuple[Any, ...]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fn(rank, world_size, *args)
    # No rank tears its gloo pairs down while a peer may still talk to it.
    dist.barrier()
    dist.destroy_process_group()
    # Seen here (torch 2.13, gloo): a rank that finished cleanly can still abort during
    # interpreter finalisation ("terminate called without an active exception", no
    # Python frame). The work is done and checked; leave without C++ static teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local_world(fn: Callable[..., None], world_size: int, *args: Any, threads_per_rank: int = 1) -> None:
    """Spawn `world_size` CPU ranks running `fn(rank, world_size, *args)` on gloo.

    `fn` must be importable (a module-level function). An exception in any rank is
    re-raised here with that rank's traceback (torch.multiprocessing.ProcessRaisedException).
    """
    mp.start_processes(
        _entry,
        args=(fn, world_size, _free_port(), threads_per_rank, args),
        nprocs=world_size,
        start_method="spawn",
    )
