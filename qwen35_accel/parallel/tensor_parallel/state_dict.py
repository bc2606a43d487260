"""Tensor-parallel state in Transformers' layout.

`state_dict()` gathers each split parameter's slices (the fused `in_proj_qkv` rows in
their original order; under FSDP2 a DTensor of the full layout, still sharded over dp);
`load_state_dict` takes full tensors (plain or DTensor) and keeps this rank's slice.
`register_optimizer_state_layout` does the same for the optimizer's state, so
torch.distributed.checkpoint (Accelerate's and the Trainer's checkpoints) saves and
resumes TP runs independently of the tp size; `load_full_state_dict` loads rank 0's full
state dict. Every conversion is collective over the tp group: call it on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ...model.detect import unwrap_qwen35
from ...model.fp32_gate import transformers_name
from ...model.state import own_state
from .splits import _Sliced, _split_entries


def _to_transformers_layout(local: torch.Tensor, sliced: _Sliced, group: dist.ProcessGroup) -> torch.Tensor:
    """The Transformers-layout tensor from this rank's slice `local` (collective over the
    tp group). A DTensor (the slice sharded by FSDP2 over dp) comes back as a DTensor of
    the full layout with the same mesh and placements, so a sharded checkpoint stays
    sharded over dp; a plain tensor comes back plain."""
    like = local if isinstance(local, DTensor) else None
    if like is not None:
        local = local.full_tensor()
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    full = sliced.gather(parts)
    if like is not None:
        full = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


def _to_local_layout(
    value: torch.Tensor, sliced: _Sliced, group: dist.ProcessGroup, param: torch.Tensor, what: str
) -> torch.Tensor:
    """This rank's slice of a Transformers-layout `value` (plain, or a DTensor of any
    placements), laid out like `param` (a DTensor over dp gets the same mesh and placements)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    expected = sliced.full_shape(param.shape, tp)
    if tuple(value.shape) != expected:
        raise ValueError(
            f"{what}: expected the Transformers layout {list(expected)} (this rank holds {list(param.shape)} "
            f"of it, tp {tp}), got {list(value.shape)}"
        )
    if isinstance(value, DTensor):
        value = value.full_tensor()
    local = sliced.local(value, rank, tp).contiguous()
    if isinstance(param, DTensor):
        local = distribute_tensor(local.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return local


# Set by `_state_dict_shapes_only`: the gather hook then describes the Transformers layout
# (meta tensors) instead of gathering it.
_SHAPES_ONLY: ContextVar[bool] = ContextVar("qwen35_accel_tp_state_dict_shapes_only", default=False)


@contextlib.contextmanager
def _state_dict_shapes_only() -> Iterator[None]:
    """Within: `state_dict()` gives each split tensor as a meta tensor of its Transformers
    shape and dtype (no communication, no memory); other entries are unchanged."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def _gather_hook(layouts: dict[str, _Sliced], group: dist.ProcessGroup) -> Callable[..., None]:
    """A module's state-dict post-hook: its split entries in Transformers' layout."""

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        shapes_only, tp = _SHAPES_ONLY.get(), dist.get_world_size(group)
        for path, sliced in layouts.items():
            key = prefix + transformers_name(path)
            if key not in state_dict:
                continue
            value = state_dict[key]
            if shapes_only:  # a DTensor's shape is already its global shape over dp
                state_dict[key] = torch.empty(sliced.full_shape(value.shape, tp), dtype=value.dtype, device="meta")
            else:
                state_dict[key] = _to_transformers_layout(value, sliced, group)

    return hook


def _slice_hook(layouts: dict[str, _Sliced], group: dist.ProcessGroup) -> Callable[..., None]:
    """A module's load-state-dict pre-hook: Transformers-layout entries to this rank's slices."""

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for path, sliced in layouts.items():
            key = prefix + transformers_name(path)
            if key in state_dict:
                owner, _, name = path.rpartition(".")
                param = module.get_submodule(owner)._parameters[name]
                state_dict[key] = _to_local_layout(state_dict[key], sliced, group, param, key)

    return hook


def gather_tensor_parallel(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The full (Transformers-layout) tensor of parameter `name` from this rank's `tensor`
    (the parameter, or its gradient; a DTensor over dp is gathered first). Collective over
    the tp group; tensors of parameters TP leaves whole are returned as they are."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    for key, _, sliced, group in _split_entries(model):
        if key == name:
            return _to_transformers_layout(tensor, sliced, group)
    return tensor


def _keyed_parameters(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> list[tuple[Any, nn.Parameter]]:
    """(state key, parameter) pairs: torch matches a state dict's groups to the optimizer's by order."""
    return [
        (key, param)
        for saved, group in zip(state_dict["param_groups"], optimizer.param_groups)
        for key, param in zip(saved["params"], group["params"])
    ]


def register_optimizer_state_layout(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Keep the optimizer state of tensor-parallel parameters in Transformers' layout, like
    `model.state_dict()`: `optimizer.state_dict()` gathers each split parameter's state
    tensors (AdamW's `exp_avg`, `exp_avg_sq`, …: those shaped like the parameter) from the
    tp ranks; `optimizer.load_state_dict()` takes Transformers-layout state (plain or
    DTensor) and keeps this rank's slice. Without it the tp ranks' slices share one key
    and torch.distributed.checkpoint (so Accelerate's and the Trainer's FSDP checkpoints)
    keeps one rank's. Both directions are collective over tp: call them on every rank.
    Checkpoints become independent of the tp size. Idempotent (the model's state keeps the
    optimizers registered); `optimizer` is the torch optimizer (an Accelerate wrapper's
    `.optimizer`). An optimizer of two models may be registered for each: each model's hooks
    convert only its own split parameters.
    """
    registered = own_state(unwrap_qwen35(model)).tp_optimizers
    if optimizer in registered:
        return

    def convert(
        opt: torch.optim.Optimizer, state_dict: dict[str, Any], fn: Callable[..., torch.Tensor], to_full: bool
    ) -> dict[str, Any]:
        """`state_dict` with each split parameter's per-element state tensors passed
        through `fn`; new per-parameter dicts (state_dict() hands out the live ones)."""
        split = {id(param): (sliced, group) for _, param, sliced, group in _split_entries(model)}
        state = dict(state_dict["state"])
        for key, param in _keyed_parameters(opt, state_dict):
            if id(param) not in split or key not in state:
                continue
            sliced, group = split[id(param)]
            converted = {}
            for name, value in state[key].items():
                # 0-d tensors (AdamW's step) are per parameter. Loading, any other shape is
                # converted, so a slice-shaped one (saved without this layout: whose slice?)
                # fails the shape check instead of loading silently.
                if torch.is_tensor(value) and value.dim() > 0 and (not to_full or value.shape == param.shape):
                    value = fn(value, sliced, group, param, f"optimizer state {key}.{name}")
                converted[name] = value
            state[key] = converted
        return {**state_dict, "state": state}

    def to_transformers(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        return convert(opt, state_dict, lambda v, sliced, group, *_: _to_transformers_layout(v, sliced, group), True)

    def to_local(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        return convert(opt, state_dict, _to_local_layout, False)

    optimizer.register_state_dict_post_hook(to_transformers)
    optimizer.register_load_state_dict_pre_hook(to_local)
    registered.add(optimizer)


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None, src: int = 0) -> None:
    """Load a full Transformers-layout state dict held by global rank `src` (other ranks
    pass None) into a model parallelized by `PARALLELIZER.apply` (tensor-parallel slices,
    FSDP2 shards): tensor by tensor broadcast, each rank keeps its part.

    For `pytorch_model_fsdp.bin` checkpoints and rank-0-only loading under tensor
    parallelism, where torch's `set_model_state_dict(..., full_state_dict=True)` would copy
    full tensors into the per-head slices. Keys must be exactly the model's
    (`model.state_dict()`), shapes the Transformers ones; otherwise ValueError on every rank
    naming them. Values are cast to the model's dtypes.
    """
    with _state_dict_shapes_only():  # shapes of the split tensors without gathering them
        target = model.state_dict()
    split_devices = {
        key: (param.to_local() if isinstance(param, DTensor) else param).device for key, param, _, _ in _split_entries(model)
    }
    problem: list[str | None] = [None]
    if dist.get_rank() == src:
        if state_dict is None:
            problem[0] = f"load_full_state_dict: rank {src} must pass the state dict"
        else:
            missing = sorted(set(target) - set(state_dict))
            unexpected = sorted(set(state_dict) - set(target))
            shapes = [
                f"{k}: {list(state_dict[k].shape)} (model {list(target[k].shape)})"
                for k in target
                if k in state_dict and tuple(state_dict[k].shape) != tuple(target[k].shape)
            ]
            if missing or unexpected or shapes:
                problem[0] = (
                    f"the state dict does not fit {type(model).__name__}: missing {missing[:8]}, "
                    f"unexpected {unexpected[:8]}, shapes {shapes[:8]}"
                )
    dist.broadcast_object_list(problem, src=src)
    if problem[0] is not None:
        raise ValueError(problem[0])
    values: dict[str, torch.Tensor] = {}
    for key, like in target.items():
        if key in split_devices:
            device = split_devices[key]
        else:
            device = like.to_local().device if isinstance(like, DTensor) else like.device
        if dist.get_rank() == src:
            full = state_dict[key].detach().to(device=device, dtype=like.dtype).contiguous()
        else:
            full = torch.empty(like.shape, dtype=like.dtype, device=device)
        dist.broadcast(full, src=src)
        if isinstance(like, DTensor) and key not in split_devices:  # split ones: the load hook slices
            full = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
        values[key] = full
    model.load_state_dict(values, strict=True)
