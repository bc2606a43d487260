"""Run a function on a local world of CPU processes over gloo (demo, tests, benchmarks).

Real jobs are launched by `accelerate launch` / `torchrun`; this is for one machine
without accelerators, where spawning N processes is the whole point. Every world has a
hard timeout: a deadlocked collective fails with each rank's Python stacks, it never
hangs the caller.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 600.0
_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)  # POSIX: each rank dumps its stacks on it
# How ranks start: "spawn" (the default: a fresh interpreter per rank) or "forkserver", where each rank
# is forked from a server process that imported PRELOAD once (the first forkserver world of this
# process starts it): a world then starts in well under a second instead of importing torch and
# Transformers on every rank (5-15 s on 2 cores). For many short worlds in one process (the tests, the
# benchmark smokes); each rank still gets the caller's current environment, but what a module reads
# from the environment at import it read when the server started.
START_METHOD_VAR = "QWEN35_LOCAL_WORLD_START_METHOD"
START_METHODS = ("spawn", "forkserver")
PRELOAD = ("torch", "torch.distributed", "transformers", "qwen35_accel",
           "transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method(method: str | None = None) -> str:
    """`method`, else $QWEN35_LOCAL_WORLD_START_METHOD, else "spawn"; checked, and for "forkserver" the
    server's preload list set (read when the server starts: later calls change nothing)."""
    source = "start" if method is not None else START_METHOD_VAR
    method = method if method is not None else os.environ.get(START_METHOD_VAR, "").strip() or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"{source}={method!r}: expected one of {START_METHODS}")
    if method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return method


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, threads: int, environ: dict[str, str], args: tuple[Any, ...]
) -> None:
    if os.environ != environ:  # a forked rank has the server's environment, not the caller's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    faulthandler.enable(all_threads=True)
    if _DUMP_SIGNAL is not None:
        faulthandler.register(_DUMP_SIGNAL, all_threads=True)
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


def _dump_stacks_and_kill(processes: list[Any]) -> None:
    alive = [p for p in processes if p.is_alive()]
    if _DUMP_SIGNAL is not None:
        for p in alive:
            os.kill(p.pid, _DUMP_SIGNAL)
        time.sleep(1.0)  # let faulthandler write the stacks
    for p in alive:
        p.kill()
    for p in alive:
        p.join(5)


def run_local_world(
    fn: Callable[..., None],
    world_size: int,
    *args: Any,
    threads_per_rank: int = 1,
    timeout: float = DEFAULT_TIMEOUT_S,
    start: str | None = None,
) -> None:
    """Start `world_size` CPU ranks running `fn(rank, world_size, *args)` on gloo.

    `fn` must be importable (a module-level function). An exception in any rank is
    re-raised here with that rank's traceback (torch.multiprocessing.ProcessRaisedException),
    the other ranks killed. If the world has not finished after `timeout` seconds, every
    rank prints its Python stacks (all threads) to stderr, is killed, and `TimeoutError`
    is raised. The ranks start as `start_method(start)` says, each with this process's environment.
    """
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), threads_per_rank, dict(os.environ), args),
        nprocs=world_size,
        start_method=start_method(start),
        join=False,
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
            _dump_stacks_and_kill(context.processes)
            raise TimeoutError(
                f"local world of {world_size} ranks running {getattr(fn, '__qualname__', fn)} did not finish within "
                f"{timeout:.0f} s; ranks {alive} were still running (their stacks are printed above) and were killed"
            )
