"""Autograd-aware collectives over a process group (gloo and NCCL alike), the lowest of
`parallel/*` (imports nothing of ours).

Megatron's f and g, on local tensors: f (`copy_to_group`): identity forward, gradient
all-reduced: a tensor-parallel block's input, and the replicated weights used on this
rank's heads only (the q/k and gated norms); g (`reduce_from_group`): all-reduce forward,
identity backward: a block's output, and the vocab-parallel loss's sums.
Context parallelism's all-gather (`all_gather_with_grad`), whose backward is a
reduce-scatter (`reduce_scatter_stack`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def flat_collective(module: Any, name: str, older_name: str) -> Callable[..., Any]:
    """`module.name`, else `module.older_name`: torch 2.13 names the flat (concatenated)
    collectives `reduce_scatter_single` / `all_gather_single` and deprecates
    `reduce_scatter_tensor` / `all_gather_into_tensor` (a FutureWarning per call), which
    are the only names torch 2.11 and 2.12 have."""
    found = getattr(module, name, None)
    return found if found is not None else getattr(module, older_name)


# Resolved once: the flat forms every backend takes (input or output dim 0 = world × dim 0),
# called as torch's: (output, input, group=...). Use these, not the torch names.
reduce_scatter_flat = flat_collective(dist, "reduce_scatter_single", "reduce_scatter_tensor")
all_gather_flat = flat_collective(dist, "all_gather_single", "all_gather_into_tensor")


def _own_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that may be reduced in place: `x` is copied once (by
    `contiguous()` when it is not contiguous, else by `clone()`)."""
    y = x.contiguous()
    return y.clone() if y is x else y


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward over a group; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        x = _own_copy(x)  # the caller's tensor stays untouched
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def reduce_from_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of `x` over `group` (any shape, same on every rank); the gradient passes through
    unchanged, so each rank's `x` gets the gradient of the sum. Collective over `group`."""
    return _ReduceFromGroup.apply(x, group)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over a group (Megatron's f)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = _own_copy(grad)  # an incoming gradient may be shared
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` unchanged (a view); backward sums the gradient over `group`."""
    return _CopyToGroup.apply(x, group)


def reduce_scatter_stack(stack: torch.Tensor, group: dist.ProcessGroup, *, all_to_all: bool | None = None) -> torch.Tensor:
    """[world, *shape] on each rank -> [*shape]: the sum over ranks of their slot `rank`.

    Each rank sends the other ranks' slots once, (world − 1)/world of the stack: the bytes
    of the all-gather it reverses. On gloo (`all_to_all=None` picks by backend) this is an
    all-to-all and a local sum in rank order: torch 2.13's gloo `reduce_scatter_single`
    computes the right values but runs an all-reduce of the whole stack (the profiler shows
    `gloo:all_reduce` of [world · n]), twice the bytes. Elsewhere (NCCL) one flat
    reduce-scatter, under the name this torch has (`flat_collective`).
    """
    stack = stack.contiguous()
    if all_to_all is None:
        all_to_all = dist.get_backend(group) == "gloo"
    if all_to_all:
        received = torch.empty_like(stack)
        dist.all_to_all_single(received, stack, group=group)
        return received.sum(dim=0, dtype=torch.float32).to(stack.dtype) if _below_fp32(stack) else received.sum(dim=0)
    # NCCL sums a bf16/fp16 reduce-scatter in that dtype, rounding at every step of its ring: with
    # more than 2 ranks the sum then depends on the ring's order. Summed in fp32 and rounded once,
    # it is what gloo's path gives (twice the bytes for those dtypes).
    widen = _below_fp32(stack) and stack.shape[0] > 2
    send = stack.float() if widen else stack
    out = send.new_empty(send.shape[1:])
    # The concatenated form (input dim 0 = world × output dim 0) is the one every backend takes.
    reduce_scatter_flat(out.view(-1), send.view(-1), group=group)
    return out.to(stack.dtype) if widen else out


def _below_fp32(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.bfloat16, torch.float16)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        world = dist.get_world_size(group)
        tensor = tensor.contiguous()
        out = tensor.new_empty((world, *tensor.shape))
        # Into the flat output (concatenated form, which gloo and NCCL both take): a list of
        # slots would make NCCL gather into a buffer of its own and copy each slot back.
        all_gather_flat(out.view(-1), tensor.view(-1), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # Every rank used every gathered slot: the input's gradient is the sum over ranks
        # of the gradient of its own slot, a reduce-scatter (the bytes of the forward).
        return reduce_scatter_stack(grad, ctx.group), None


def all_gather_with_grad(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[*shape] on each rank -> [world, *shape] (rank order); gradients flow back exactly.

    Backward is one reduce-scatter of the [world, *shape] gradient (`reduce_scatter_stack`:
    the forward's bytes, on gloo too).
    """
    return _AllGather.apply(tensor, group)
