"""Head-parallel tensor parallelism for dense Qwen3.5 (Megatron style, local tensors).

Each tp rank keeps whole heads: its slice of every head-indexed projection, and runs the
token mixers on those heads only. In particular each rank's GatedDeltaNet recurrence runs
on num_value_heads / tp heads (Transformers' plan gathers every projection and runs all of
them on every rank). Per decoder layer:

- GatedDeltaNet: the q, k and v segments of the fused `in_proj_qkv` by key / value heads
  (rank r owns key heads r·Hk/tp… and the value heads they serve, so GQA stays local),
  `conv1d` channels to match, `in_proj_z`/`in_proj_b`/`in_proj_a` and the gate holder's
  `A_log`/`dt_bias` by value heads, the gated norm replicated (per head), `out_proj` by
  input columns;
- attention: `q_proj` (query and output gate of each head), `k_proj`, `v_proj` by heads,
  `q_norm`/`k_norm` replicated, `o_proj` by input columns;
- MLP: `gate_proj`/`up_proj` by rows, `down_proj` by columns.
Each block's input is the identity forward / all-reduce backward, its output an
all-reduce forward / identity backward; replicated weights used on local heads (the
norms) get their gradients all-reduced. Embeddings, layer norms and lm_head stay
replicated. Parameters are plain tensors holding the local slice, so FSDP2 over the
`dp_shard_cp` mesh and context parallelism compose unchanged.

State dicts are in Transformers' layout: `state_dict()` gathers the slices (the fused
`in_proj_qkv` rows in their original order; under FSDP2 a DTensor of the full layout,
still sharded over dp), `load_state_dict` takes full tensors (plain or DTensor) and keeps
this rank's slice. `register_optimizer_state_layout` does the same for the optimizer's
state, so torch.distributed.checkpoint (Accelerate's and the Trainer's checkpoints) saves
and resumes TP runs, independently of the tp size; `load_full_state_dict` loads rank 0's
full state dict.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers.activations import ACT2FN
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ..model.detect import qwen35_parts
from ..model.fp32_gate import HOLDER_NAME

TP_GROUP_ATTR = "_qwen35_tp_group"


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


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce forward over the tp group; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, group)


class TensorParallelRMSNorm(hf.Qwen3_5RMSNorm):
    """`Qwen3_5RMSNorm` applied to this rank's heads (q_norm/k_norm): replicated weight,
    gradient all-reduced over the tp group. Same arithmetic as Transformers'."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, getattr(self, TP_GROUP_ATTR))
        output = self._norm(x.float())
        return (output * (1.0 + weight.float())).type_as(x)


class TensorParallelRMSNormGated(hf.Qwen3_5RMSNormGated):
    """GatedDeltaNet's per-head gated norm on this rank's heads (weight replicated,
    gradient all-reduced). Same arithmetic as Transformers'."""

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, getattr(self, TP_GROUP_ATTR))
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = weight * hidden_states.to(input_dtype)
        hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))
        return hidden_states.to(input_dtype)


# ------------------------------------------------------------------ layouts

Slicer = Callable[[torch.Tensor, int, int], torch.Tensor]  # (full, rank, tp) -> local


def _blocks(sizes: list[int]) -> Slicer:
    """Dim-0 segments of the given sizes, each cut into tp equal parts; rank r keeps part r
    of every segment, concatenated (e.g. the q, k, v segments of in_proj_qkv)."""

    def slicer(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        parts, start = [], 0
        for size in sizes:
            step = size // tp
            parts.append(full.narrow(0, start + rank * step, step))
            start += size
        return torch.cat(parts, dim=0)

    return slicer


def _columns(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    step = full.shape[1] // tp
    return full.narrow(1, rank * step, step)


def _unslice_blocks(sizes: list[int], parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `_blocks`: parts[r] is rank r's concatenation."""
    tp = len(parts)
    segments = []
    offsets = [0] * tp
    for size in sizes:
        step = size // tp
        for r in range(tp):
            segments.append(parts[r].narrow(0, offsets[r], step))
            offsets[r] += step
    return torch.cat(segments, dim=0)


class _Sliced:
    """How one parameter is split: `kind` "rows" (with dim-0 segment sizes) or "cols"."""

    def __init__(self, kind: str, sizes: list[int] | None = None) -> None:
        self.kind, self.sizes = kind, sizes

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        return _blocks(self.sizes)(full, rank, tp) if self.kind == "rows" else _columns(full, rank, tp)

    def gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return _unslice_blocks(self.sizes, parts) if self.kind == "rows" else torch.cat(parts, dim=1)

    def full_shape(self, local_shape: torch.Size | tuple[int, ...], tp: int) -> tuple[int, ...]:
        dim = 0 if self.kind == "rows" else 1
        return tuple(n * tp if i == dim else n for i, n in enumerate(local_shape))


def _rows(*sizes: int) -> _Sliced:
    return _Sliced("rows", list(sizes))


_COLS = _Sliced("cols")


def check_divisible(config: Any, tp: int) -> None:
    """ValueError naming every head count (and the MLP width) that tp does not divide."""
    counts = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = {name: n for name, n in counts.items() if n % tp}
    if bad:
        common = math.gcd(*counts.values())
        sizes = [d for d in range(1, common + 1) if common % d == 0]
        raise ValueError(
            "tensor parallelism splits whole heads: tp size "
            f"{tp} must divide " + ", ".join(f"{name} = {n}" for name, n in bad.items())
            + f"; this model takes tp sizes {sizes} (parallelism_config_tp_size)"
        )


def _layouts(layer: nn.Module, config: Any) -> dict[str, _Sliced]:
    """{parameter path inside the decoder layer: how it is split} for one layer."""
    out: dict[str, _Sliced] = {"mlp.gate_proj.weight": _rows(config.intermediate_size),
                               "mlp.up_proj.weight": _rows(config.intermediate_size),
                               "mlp.down_proj.weight": _COLS}
    if layer.block_type == "linear_attention":
        gdn = layer.linear_attn
        qkv = [gdn.key_dim, gdn.key_dim, gdn.value_dim]
        out.update({
            "linear_attn.in_proj_qkv.weight": _rows(*qkv),
            "linear_attn.conv1d.weight": _rows(*qkv),
            "linear_attn.in_proj_z.weight": _rows(gdn.value_dim),
            "linear_attn.in_proj_b.weight": _rows(gdn.num_v_heads),
            "linear_attn.in_proj_a.weight": _rows(gdn.num_v_heads),
            f"linear_attn.{HOLDER_NAME}.A_log": _rows(gdn.num_v_heads),
            f"linear_attn.{HOLDER_NAME}.dt_bias": _rows(gdn.num_v_heads),
            "linear_attn.out_proj.weight": _COLS,
        })
        if gdn.conv1d.bias is not None:
            out["linear_attn.conv1d.bias"] = _rows(*qkv)
    else:
        attn = layer.self_attn
        q_rows = config.num_attention_heads * attn.head_dim * 2
        kv_rows = config.num_key_value_heads * attn.head_dim
        for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            out[f"self_attn.{name}.weight"] = _rows(rows)
            if getattr(attn, name).bias is not None:
                out[f"self_attn.{name}.bias"] = _rows(rows)
        out["self_attn.o_proj.weight"] = _COLS
    return out


def _state_dict_key(path: str) -> str:
    return path.replace(f".{HOLDER_NAME}.", ".")


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
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        shapes_only, tp = _SHAPES_ONLY.get(), dist.get_world_size(group)
        for path, sliced in layouts.items():
            key = prefix + _state_dict_key(path)
            if key not in state_dict:
                continue
            value = state_dict[key]
            if shapes_only:  # a DTensor's shape is already its global shape over dp
                state_dict[key] = torch.empty(sliced.full_shape(value.shape, tp), dtype=value.dtype, device="meta")
            else:
                state_dict[key] = _to_transformers_layout(value, sliced, group)

    return hook


def _slice_hook(layouts: dict[str, _Sliced], group: dist.ProcessGroup) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for path, sliced in layouts.items():
            key = prefix + _state_dict_key(path)
            if key in state_dict:
                owner, _, name = path.rpartition(".")
                param = module.get_submodule(owner)._parameters[name]
                state_dict[key] = _to_local_layout(state_dict[key], sliced, group, param, key)

    return hook


def _input_hook(group: dist.ProcessGroup) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = copy_to_tp(kwargs["hidden_states"], group)
        else:
            args = (copy_to_tp(args[0], group), *args[1:])
        return args, kwargs

    return hook


def _output_hook(group: dist.ProcessGroup) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (reduce_from_tp(output[0], group), *output[1:])
        return reduce_from_tp(output, group)

    return hook


def _split_module(module: nn.Module, layouts: dict[str, _Sliced], tp_mesh: DeviceMesh) -> None:
    """Replace the parameters named in `layouts` (paths inside `module`) by this rank's
    slices and give `module` the state-dict hooks of the Transformers layout."""
    tp, rank, group = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    for path, sliced in layouts.items():
        owner_path, _, name = path.rpartition(".")
        owner = module.get_submodule(owner_path)
        param = owner._parameters[name]
        local = sliced.local(param.detach(), rank, tp).clone()
        owner._parameters[name] = nn.Parameter(local, requires_grad=param.requires_grad)
    module._qwen35_tp_layouts = layouts
    module.register_state_dict_post_hook(_gather_hook(layouts, group))
    module.register_load_state_dict_pre_hook(_slice_hook(layouts, group))
    setattr(module, TP_GROUP_ATTR, group)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> int:
    """Split a dense Qwen3.5 model's decoder layers by heads over `tp_mesh`, in place.

    Preconditions: fp32 gate holders installed; not yet sharded by FSDP2; the same
    weights on every tp rank (they are sliced, not communicated). Creates new Parameter
    objects: build the optimizer afterwards. Returns the number of layers split.
    Raises ValueError naming every head count the tp size does not divide.
    """
    parts = qwen35_parts(model)
    config = model.config.get_text_config()
    tp = tp_mesh.size()
    group = tp_mesh.get_group()
    check_divisible(config, tp)
    for layer in parts.decoder_layers:
        _split_module(layer, _layouts(layer, config), tp_mesh)
        if layer.block_type == "linear_attention":
            gdn = layer.linear_attn
            gdn.num_v_heads //= tp
            gdn.num_k_heads //= tp
            gdn.key_dim //= tp
            gdn.value_dim //= tp
            gdn.conv_dim //= tp
            mixer = gdn
            norms = [gdn.norm]
        else:
            mixer = layer.self_attn
            norms = [mixer.q_norm, mixer.k_norm]
        for norm in norms:
            norm.__class__ = TensorParallelRMSNormGated if isinstance(norm, hf.Qwen3_5RMSNormGated) else TensorParallelRMSNorm
            setattr(norm, TP_GROUP_ATTR, group)
        for block in (mixer, layer.mlp):
            block.register_forward_pre_hook(_input_hook(group), with_kwargs=True)
            block.register_forward_hook(_output_hook(group), with_kwargs=True)
    return len(parts.decoder_layers)


# ------------------------------------------------------------------ vocab-parallel lm_head

VOCAB_GROUP_ATTR = "_qwen35_vocab_group"
IGNORE_INDEX = -100


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token cross entropy [N] (0 where `target == ignore_index`) from this rank's
    vocab slice of the logits, without gathering them.

    `logits`: [N, V / tp], rank r holding vocab entries r·V/tp …; `target`: [N] global
    token ids. The max, the sum of exponentials and the target's logit are combined over
    the tp group (three [N] all-reduces); the gradient reaches each rank's slice only.
    Collective over `group`: every rank passes the same `target`.
    """
    logits = logits.float()
    local_vocab = logits.shape[-1]
    start = dist.get_rank(group) * local_vocab
    with torch.no_grad():  # a constant shift: softmax and its gradient do not depend on it
        shift = logits.max(dim=-1).values
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - shift.unsqueeze(-1)
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), group)
    valid = target != ignore_index
    local_target = target - start
    mine = valid & (local_target >= 0) & (local_target < local_vocab)
    # Advanced indexing keeps only the indices for backward (gather would keep `shifted`).
    rows = torch.arange(shifted.shape[0], device=shifted.device)
    picked = shifted[rows, local_target.clamp(0, local_vocab - 1)]
    target_logit = reduce_from_tp(picked * mine, group)
    return (sum_exp.log() - target_logit) * valid


class VocabParallelCausalLMLoss:
    """`model.loss_function` for a vocab-parallel lm_head: Transformers' causal-LM loss
    (shift, `num_items_in_batch` → sum / count, else mean) on vocab-sliced logits."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels, self.group, ignore_index)
        if num_items_in_batch is None:
            return losses.sum() / (shift_labels != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(losses.device)
        return losses.sum() / num_items_in_batch


def check_vocab_parallel(model: nn.Module, tp: int) -> None:
    """ValueError if the lm_head cannot be split by vocab over `tp` ranks (tied to the
    input embedding, or a vocab size tp does not divide)."""
    parts = qwen35_parts(model)
    weight = parts.lm_head.weight
    if weight is parts.embed_tokens.weight:
        raise ValueError(
            "a vocab-parallel lm_head needs untied embeddings (tie_word_embeddings=False): the input embedding "
            "shares its weight and stays replicated"
        )
    if weight.shape[0] % tp:
        raise ValueError(f"a vocab-parallel lm_head needs tp size {tp} to divide the vocab size {weight.shape[0]}")


def apply_vocab_parallel_lm_head(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the lm_head by vocab rows over `tp_mesh` and install `VocabParallelCausalLMLoss`.

    Each rank computes logits for its V / tp vocab entries only ([…, V / tp], what the
    model returns as `logits`: `gather_vocab_parallel_logits` assembles them) and the
    loss combines the slices without gathering them: the lm_head's activations and the
    loss's fp32 logits shrink by tp. The state dict keeps the full Transformers layout.
    Preconditions: as `apply_tensor_parallel`; see `check_vocab_parallel`.
    """
    check_vocab_parallel(model, tp_mesh.size())
    group = tp_mesh.get_group()
    lm_head = qwen35_parts(model).lm_head
    _split_module(lm_head, {name: _rows(p.shape[0]) for name, p in lm_head.named_parameters(recurse=False)}, tp_mesh)
    lm_head.register_forward_pre_hook(_input_hook(group), with_kwargs=True)
    setattr(model, VOCAB_GROUP_ATTR, group)
    model.loss_function = VocabParallelCausalLMLoss(group)


@torch.no_grad()
def gather_vocab_parallel_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The full-vocab logits from this rank's slice (collective over tp; no autograd).
    Returns `logits` unchanged if the model's lm_head is not vocab-parallel."""
    group = getattr(model, VOCAB_GROUP_ATTR, None)
    if group is None:
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_entries(model: nn.Module) -> list[tuple[str, nn.Parameter, _Sliced, dist.ProcessGroup]]:
    """(state-dict key, parameter as the model holds it now, split, tp group) for every
    parameter tensor parallelism split. Look them up when needed: FSDP2 replaces the
    Parameter objects."""
    entries = []
    for prefix, module in model.named_modules():
        layouts = getattr(module, "_qwen35_tp_layouts", None)
        for path, sliced in (layouts or {}).items():
            owner, _, name = path.rpartition(".")
            key = f"{prefix}.{_state_dict_key(path)}" if prefix else _state_dict_key(path)
            entries.append((key, module.get_submodule(owner)._parameters[name], sliced, getattr(module, TP_GROUP_ATTR)))
    return entries


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


def tensor_parallel_sliced(model: nn.Module) -> set[int]:
    """ids of the parameters tensor parallelism split (as the model holds them now)."""
    return {id(param) for _, param, _, _ in _split_entries(model)}


def tensor_parallel_group(model: nn.Module) -> dist.ProcessGroup | None:
    for module in model.modules():
        group = getattr(module, TP_GROUP_ATTR, None)
        if group is not None:
            return group
    return None


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
    Checkpoints become independent of the tp size. Idempotent; `optimizer` is the torch
    optimizer (an Accelerate wrapper's `.optimizer`).
    """
    registered = getattr(optimizer, "_qwen35_tp_layout_of", None)
    if registered is not None:
        if registered() is not model:
            raise ValueError("this optimizer's state layout is already registered for another model")
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
    optimizer._qwen35_tp_layout_of = weakref.ref(model)


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
                if placement.is_shard():
                    dist.all_reduce(acc, op=op, group=like.device_mesh.get_group(dim))
        totals.append(acc)
    stacked = torch.stack(totals)
    split_whole = stacked.max(dim=0).values if inf else stacked.sum(dim=0)
    split, whole = split_whole[0].clone(), split_whole[1]
    if group is not None:  # the split parameters' pieces live on the tp ranks too
        dist.all_reduce(split, op=op, group=group)
    total = torch.maximum(split, whole) if inf else (split + whole) ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coefficient.to(p.grad.device))
    return total
