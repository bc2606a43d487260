"""Per-step patch points: the step's context-parallel batch sharding and gradient clipping
under tensor parallelism."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch


def maybe_context_parallel(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    @contextlib.contextmanager
    def wrapper(
        self: Any,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        cp_mesh = getattr(self, "_qwen35_cp_mesh", None)
        if cp_mesh is None:
            with original(self, buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers):
                yield
            return
        from ..context_parallel import sharded_buffers

        with sharded_buffers(buffers or [], buffer_seq_dims, no_restore_buffers, cp_mesh):
            yield

    return wrapper


def clip_grad_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        from ..parallel.tensor_parallel import clip_grad_norm_, tensor_parallel_group

        models = [m for m in getattr(self, "_models", []) if getattr(m, "_qwen35_accel_prepared", False)]
        if len(models) == 1 and tensor_parallel_group(models[0]) is not None:
            parameters = list(parameters)
            if {id(p) for p in parameters} == {id(p) for p in models[0].parameters()}:
                return clip_grad_norm_(models[0], max_norm, norm_type)
            raise NotImplementedError(
                "clip_grad_norm_ on a subset of a tensor-parallel Qwen3.5 model's parameters is not supported; "
                "pass model.parameters()"
            )
        return original(self, parameters, max_norm, norm_type)

    return wrapper
