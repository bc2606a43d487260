"""Gradient clipping for a tensor-parallel (and FSDP2-sharded) model."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from .splits import tensor_parallel_group, tensor_parallel_sliced


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a tensor-parallel model: returns the norm of the
    whole model's gradient and scales every gradient by the same factor on every rank.

    Plain `clip_grad_norm_` on a TP model sees only this rank's slices of the split
    parameters and so clips each tp rank by a different, too small norm. Here the split
    parameters' gradients are summed over their FSDP shards and the tp group, the
    replicated ones over their FSDP shards only: a few collectives per call, not one per
    parameter. `norm_type` any p > 0, or inf.
    """
    group = tensor_parallel_group(model)
    sliced_ids = tensor_parallel_sliced(model)
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    inf = norm_type == float("inf")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    # One [split, whole] accumulator per FSDP layout (mesh, placements): local pieces are
    # combined locally, then reduced once over that layout's shard dims (not once per
    # parameter; replicated dims of HSDP hold copies and are not summed).
    layouts: dict[tuple, tuple[Any, torch.Tensor]] = {}
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        key = (id(p.grad.device_mesh), tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
        like = p.grad if isinstance(p.grad, DTensor) else None
        acc = layouts.setdefault(key, (like, torch.zeros(2, device=grad.device)))[1]
        if grad.numel() == 0:  # an FSDP shard can be empty (fewer rows than ranks)
            continue
        value = torch.linalg.vector_norm(grad.float(), norm_type)
        slot = 0 if id(p) in sliced_ids else 1
        acc[slot] = torch.maximum(acc[slot], value) if inf else acc[slot] + value**norm_type
    totals = []
    for like, acc in layouts.values():
        if like is not None:
            for dim, placement in enumerate(like.placements):
                # FSDP2 over an already split dim (experts split over ep or tp) is a _StridedShard,
                # which is not `is_shard()`: its pieces must be summed too.
                if placement.is_shard() or isinstance(placement, _StridedShard):
                    dist.all_reduce(acc, op=op, group=like.device_mesh.get_group(dim))
        totals.append(acc)
    stacked = torch.stack(totals)
    split_whole = stacked.max(dim=0).values if inf else stacked.sum(dim=0)
    split, whole = split_whole[0].clone(), split_whole[1]
    if group is not None:  # the split parameters' pieces live on the tp ranks too
        dist.all_reduce(split, op=op, group=group)
    total = torch.maximum(split, whole) if inf else (split + whole) ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # One multi-tensor multiply per (device, dtype), on the local shards (in place: a
    # DTensor's local tensor is its storage).
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), grads in groups.items():
        torch._foreach_mul_(grads, coefficient.to(device))
    return total


def check_one_gradient_mesh(model: nn.Module) -> None:
    """Raise ValueError when `model`'s trainable parameters live on more than one device mesh (plain
    tensors count as one more). Under tp the Trainer would then compute the gradient norm itself, one
    norm per mesh (Transformers' `Trainer._mixed_mesh_grad_norm`), instead of
    `Accelerator.clip_grad_norm_` and so `clip_grad_norm_` here: each tp rank's slices alone, a too
    small norm, clipped by silently."""
    meshes: dict[Any, list[str]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            meshes.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(name)
    if len(meshes) > 1:
        found = "; ".join(f"{'plain tensors' if mesh is None else f'mesh {dict(zip(mesh.mesh_dim_names or (), mesh.shape))}'}: "
                          f"{len(names)} parameters (e.g. {names[0]})" for mesh, names in meshes.items())
        raise ValueError(
            f"under tensor parallelism every trainable parameter must live on one device mesh; found {len(meshes)}: {found}. "
            "The Trainer would compute the gradient norm per mesh itself (Trainer._mixed_mesh_grad_norm), bypassing the "
            "tensor-parallel norm, and clip by a too small norm. Freeze the parameters outside the sharded model or shard them too."
        )

