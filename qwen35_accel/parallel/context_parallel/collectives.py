"""Autograd-aware collectives for context parallelism (gloo and NCCL alike)."""

from __future__ import annotations

import torch
import torch.distributed as dist

_REDUCE_SCATTER_BACKENDS = {"nccl", "xccl"}


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        world = dist.get_world_size(group)
        tensor = tensor.contiguous()
        out = tensor.new_empty((world, *tensor.shape))
        dist.all_gather(list(out.unbind(0)), tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # Every rank used every gathered slot: the input's gradient is the sum over ranks
        # of the gradient of its own slot (a reduce-scatter).
        group = ctx.group
        grad = grad.contiguous()
        if dist.get_backend(group) in _REDUCE_SCATTER_BACKENDS:
            out = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad.flatten(0, 1), group=group)
            return out, None
        # gloo has no reduce-scatter: all-reduce the (small) stack and keep our slot.
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad[dist.get_rank(group)].clone(), None


def all_gather_with_grad(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[*shape] on each rank -> [world, *shape] (rank order); gradients flow back exactly."""
    return _AllGather.apply(tensor, group)
