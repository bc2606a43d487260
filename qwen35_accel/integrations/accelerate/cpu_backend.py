"""FSDP configs on machines without accelerators: FSDP2 over gloo, and its exit.

Stock Accelerate ignores the FSDP plugin on CPU and every process of an `accelerate
launch` trains its own copy (`DistributedType.NO`). Two patch points make
such a launch run FSDP2 over gloo: `_prepare_backend` answers ("gloo", MULTI_CPU) and
`AcceleratorState.__init__` turns MULTI_CPU with an FSDP plugin into FSDP.

The exit teardown (`close_gloo_group_at_exit`) is bounded: a rank that ends through an
uncaught exception leaves at once (its peers may sit in a collective with it; the
launcher ends them once this rank's non-zero exit code arrives), and a rank that ends
normally waits for its peers at most `QWEN35_ACCEL_EXIT_BARRIER_TIMEOUT` seconds.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..notices import main_process_note
from ...settings import PluginSettings


def no_accelerator() -> bool:
    """True when torch sees no accelerator (CUDA, XPU, MPS, …) on this machine."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return not accelerator.is_available()
    return not torch.cuda.is_available()


def cpu_launch_wanted() -> bool:
    """An FSDP or DeepSpeed launch of several processes on a machine without accelerators."""
    from accelerate.utils import get_int_from_env

    world = get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)
    return (
        PluginSettings.from_env().cpu_fsdp
        and (os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
             or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true")
        and world > 1
        and no_accelerator()
    )


def exiting_through_exception() -> bool:
    """Whether the interpreter is ending because of an uncaught exception.

    The interpreter prints such an exception (and stores it in `sys.last_value`) before
    it runs the `atexit` functions; `sys.exit(n)` stores nothing.
    """
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def close_gloo_group_at_exit() -> None:
    """Tear the gloo group down while the interpreter is still whole, never unboundedly.

    Left to interpreter finalisation, a finished rank's gloo group is destroyed after
    Python's own state is gone, and gloo's worker threads can then abort the process
    ("terminate called without an active exception"). So a rank that ends normally
    waits for its peers (a monitored barrier, bounded by the exit barrier timeout: no
    rank closes its connections while a peer may still talk to it), destroys the group
    and collects what still references gloo work. A rank ending through an exception
    does none of this: a barrier would wait for peers that sit in a collective with
    this rank until gloo's own timeout (30 minutes by default), and destroying a group
    with work in flight can block as well.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return
    if exiting_through_exception():
        sys.stderr.flush()
        return
    timeout = PluginSettings.from_env().exit_barrier_timeout
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except Exception as error:  # a peer failed or is late: it decides the launch's exit code
        print(
            f"[qwen35_accel] rank {dist.get_rank()}: peers did not reach the exit barrier within {timeout} s "
            f"({str(error).splitlines()[0]}); leaving without tearing the gloo group down "
            "(QWEN35_ACCEL_EXIT_BARRIER_TIMEOUT sets the wait)",
            file=sys.stderr,
            flush=True,
        )
        return
    dist.destroy_process_group()
    gc.collect()  # gloo work objects still referenced from Python go now, not at finalisation


_exit_hook_registered = False


def prepare_backend(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch of `PartialState._prepare_backend`: gloo and MULTI_CPU for a CPU FSDP or DeepSpeed launch (Accelerate
    then initialises DeepSpeed's communication over gloo: its DeepSpeed branch runs where `cpu` is unset)."""

    @functools.wraps(original)
    def wrapper(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        from accelerate.utils import DistributedType

        global _exit_hook_registered
        chosen_backend, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if distributed_type == DistributedType.NO and backend in (None, "gloo") and cpu_launch_wanted():
            if not _exit_hook_registered:
                atexit.register(close_gloo_group_at_exit)
                _exit_hook_registered = True
            return "gloo", DistributedType.MULTI_CPU
        return chosen_backend, distributed_type

    return wrapper


def accelerator_state_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch of `AcceleratorState.__init__`: MULTI_CPU with an FSDP2 plugin becomes FSDP; an FSDP1
    plugin stays Accelerate's MULTI_CPU (DDP over gloo), said once."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        from accelerate.utils import DistributedType

        original(self, *args, **kwargs)
        fsdp_plugin = kwargs.get("fsdp_plugin")
        if (
            fsdp_plugin is not None
            and getattr(self, "distributed_type", None) == DistributedType.MULTI_CPU
            and no_accelerator()
            and PluginSettings.from_env().cpu_fsdp
        ):
            if fsdp_plugin.fsdp_version != 2:  # FSDP1 has no CPU path: Accelerate's own MULTI_CPU (DDP over gloo)
                main_process_note(
                    "no accelerator found: an FSDP v1 config runs as DDP over gloo (Accelerate's MULTI_CPU; FSDP v1 has "
                    "no CPU path). qwen35_accel runs FSDP2 on CPU: `accelerate to-fsdp2 --config_file CONFIG "
                    "--output_file NEW` converts the YAML"
                )
                return
            from accelerate.state import PartialState

            self.distributed_type = DistributedType.FSDP
            # As Accelerate does at the end of its own __init__: later AcceleratorState()
            # calls copy PartialState's shared state over this one.
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            main_process_note(f"no accelerator found: FSDP{fsdp_plugin.fsdp_version} runs on CPU over gloo")

    return wrapper
