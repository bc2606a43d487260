"""Megatron's f and g over the tp group, as autograd functions on local tensors.

f (`copy_to_tp`): identity forward, gradient all-reduced: a block's input, and the
replicated weights used on this rank's heads only (the q/k and gated norms).
g (`reduce_from_tp`): all-reduce forward, identity backward: a block's output. It is
defined with the losses (`parallel/losses.py`, which the vocab-parallel loss needs and
CP imports) so that nothing below TP imports TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..losses import reduce_from_group as reduce_from_tp

__all__ = ["copy_to_tp", "reduce_from_tp"]


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the tp group (Megatron's f)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` unchanged (a view); backward sums the gradient over `group`."""
    return _CopyToTensorParallel.apply(x, group)
