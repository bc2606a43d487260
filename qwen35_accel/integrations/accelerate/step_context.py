"""Accelerate's per-step points: the step's context-parallel context (`maybe_context_parallel`) shards
the step's buffers with the package's layout, and `clip_grad_norm_` takes the whole gradient's norm
under tensor parallelism."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..targets import accelerator_cp_mesh, prepared_by_accelerate


def maybe_context_parallel(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    @contextlib.contextmanager
    def wrapper(
        self: Any,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        cp_mesh = accelerator_cp_mesh(self)
        if cp_mesh is None:
            with original(self, buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers):
                yield
            return
        from ...context_parallel import sharded_buffers

        with sharded_buffers(buffers or [], buffer_seq_dims, no_restore_buffers, cp_mesh):
            yield

    return wrapper


def clip_grad_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        from ...parallel.tensor_parallel import clip_grad_norm_, tensor_parallel_group

        models = [m for m in getattr(self, "_models", []) if prepared_by_accelerate(m)]
        models = [m for m in models if tensor_parallel_group(m) is not None]
        if models:
            parameters = list(parameters)
            given = {id(p) for p in parameters}
            for model in models:  # the one being clipped (a frozen reference model may be prepared too)
                if given == {id(p) for p in model.parameters()}:
                    return clip_grad_norm_(model, max_norm, norm_type)
            raise NotImplementedError(
                "clip_grad_norm_ on a subset of a tensor-parallel Qwen3.5 model's parameters is not supported; "
                "pass model.parameters()"
            )
        return original(self, parameters, max_norm, norm_type)

    return wrapper
