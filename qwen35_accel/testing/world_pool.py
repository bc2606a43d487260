"""Gloo worlds kept alive between tests: each world size is spawned once and runs one
function after another (tests only).

Spawning a world costs every rank its imports (torch, Transformers, this package: about
5 s per rank on an idle 2-core machine, several times that under load), paid again by every
test that spawns one. A pooled world pays it once. Each task runs as in a fresh world
(`run_local_world`'s contract: `fn(rank, world_size, *args)` on every rank, an exception on
any rank re-raised here with its traceback, a hard timeout that prints every rank's stacks),
and what a task may leave behind is put back after it: environment variables, `sys.path`,
warning filters, the default dtype, grad mode, deterministic algorithms, thread count,
Accelerate's singletons. A world whose task failed or timed
out is killed and spawned afresh for the next one, since its ranks may be stuck inside a
collective. `QWEN35_TESTING_FRESH_WORLDS=1` spawns a world per task instead.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import queue
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..local_world import _DUMP_SIGNAL, DEFAULT_TIMEOUT_S, _dump_stacks_and_kill, free_port, run_local_world

FRESH_WORLDS_VARIABLE = "QWEN35_TESTING_FRESH_WORLDS"


def reset_process_state(
    environ: dict[str, str], path: list[str], filters: list[Any], dtype: torch.dtype, deterministic: bool, threads: int
) -> None:
    """Put back what a task may have changed in this process (a pooled rank's, or one running
    several scripts one after the other: tests/scripts/several_runs.py)."""
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    warnings.filters[:] = filters  # a task's simplefilter("error", ...) must not reach the next one
    getattr(warnings, "_filters_mutated", lambda: None)()  # drop cached per-module verdicts (CPython)
    torch.use_deterministic_algorithms(deterministic)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(True)
    torch.set_num_threads(threads)
    if "accelerate.state" in sys.modules:  # the next task's Accelerator starts from scratch
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState._reset_state()


def _serve(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    """A pooled rank: join the gloo world, then run tasks until told to stop (None)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    faulthandler.enable(all_threads=True)
    if _DUMP_SIGNAL is not None:
        faulthandler.register(_DUMP_SIGNAL, all_threads=True)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    environ, path, filters = dict(os.environ), list(sys.path), list(warnings.filters)
    dtype, deterministic = torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()
    while (task := tasks.get()) is not None:
        fn, args, threads = task
        torch.set_num_threads(threads)
        try:
            fn(rank, world_size, *args)
            dist.barrier()  # every rank done before any starts the next task
        except BaseException:  # noqa: BLE001 - reported to the parent, which kills this world
            results.put((rank, traceback.format_exc()))
            sys.stdout.flush()
            sys.stderr.flush()
            time.sleep(3600)  # peers may be stuck in a collective: the parent kills us all
        reset_process_state(environ, path, filters, dtype, deterministic, threads)
        results.put((rank, None))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see local_world._entry: no gloo teardown at interpreter exit


class _World:
    def __init__(self, world_size: int) -> None:
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [context.Queue() for _ in range(world_size)]
        self.results = context.Queue()
        port = free_port()
        self.processes = [
            context.Process(target=_serve, args=(rank, world_size, port, self.tasks[rank], self.results), daemon=True)
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    def run(self, fn: Callable[..., None], args: tuple[Any, ...], threads: int, timeout: float) -> None:
        for rank_tasks in self.tasks:
            rank_tasks.put((fn, args, threads))
        deadline = time.monotonic() + timeout
        done: set[int] = set()
        while len(done) < self.world_size:
            try:
                rank, error = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [rank for rank, p in enumerate(self.processes) if not p.is_alive()]
                if dead:
                    raise RuntimeError(
                        f"ranks {dead} of a pooled world of {self.world_size} exited while running "
                        f"{getattr(fn, '__qualname__', fn)} (exit codes {[self.processes[r].exitcode for r in dead]})"
                    ) from None
                if time.monotonic() >= deadline:
                    alive = [rank for rank in range(self.world_size) if rank not in done]
                    _dump_stacks_and_kill(self.processes)
                    raise TimeoutError(
                        f"local world of {self.world_size} ranks running {getattr(fn, '__qualname__', fn)} did not "
                        f"finish within {timeout:.0f} s; ranks {alive} were still running (their stacks are printed "
                        "above) and were killed"
                    ) from None
                continue
            if error is not None:
                raise mp.ProcessRaisedException(
                    f"\n\n-- Process {rank} terminated with the following error:\n{error}", rank, self.processes[rank].pid
                )
            done.add(rank)

    def close(self, graceful: bool) -> None:
        if graceful:
            for rank_tasks in self.tasks:
                rank_tasks.put(None)
            for process in self.processes:
                process.join(10)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


_WORLDS: dict[int, _World] = {}


def run_pooled_world(
    fn: Callable[..., None], world_size: int, *args: Any, threads_per_rank: int = 1, timeout: float = DEFAULT_TIMEOUT_S
) -> None:
    """`run_local_world(fn, world_size, *args)` on a world of this size kept from an earlier
    call (spawned on first use). Same contract: `fn` importable, an exception on any rank
    raised here with its traceback, `TimeoutError` after `timeout` seconds."""
    if os.environ.get(FRESH_WORLDS_VARIABLE) == "1":
        run_local_world(fn, world_size, *args, threads_per_rank=threads_per_rank, timeout=timeout)
        return
    world = _WORLDS.get(world_size)
    if world is None:
        world = _WORLDS[world_size] = _World(world_size)
    try:
        world.run(fn, args, threads_per_rank, timeout)
    except BaseException:
        del _WORLDS[world_size]
        world.close(graceful=False)
        raise


@atexit.register
def _close_worlds() -> None:
    for world in _WORLDS.values():
        world.close(graceful=True)
    _WORLDS.clear()
