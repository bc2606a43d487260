"""Putting a process back as a fresh one would be after a script ran in it (tests only):
tests/scripts/several_runs.py runs several scripts one after the other in one launch."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch


def reset_process_state(
    environ: dict[str, str], path: list[str], filters: list[Any], dtype: torch.dtype, deterministic: bool, threads: int
) -> None:
    """Put back what a script run may have changed in this process (one running several scripts
    one after the other: tests/scripts/several_runs.py). The process groups a run made stay: destroyed
    between runs, a later run's mesh of the same layout still named one ("Could not resolve the process
    group registered under the name 65", 4-rank launches, torch 2.13)."""
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
