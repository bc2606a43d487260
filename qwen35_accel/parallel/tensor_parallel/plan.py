"""Which parameters tensor parallelism splits and how, and applying the split.

Each tp rank keeps whole heads: its slice of every head-indexed projection, and runs the
token mixers on those heads only (see the package docstring for the per-layer plan).
Each block's input is f (`copy_to_group`), its output g (`reduce_from_group`) over the tp
group; the norms used on local heads keep a replicated weight whose gradient is
all-reduced. Optionally the lm_head is split by vocab rows too, with a loss that never
gathers the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.activations import ACT2FN
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from ...model.detect import FAMILIES, Qwen35Parts, qwen35_parts
from ...model.fp32_gate import HOLDER_NAME
from ...model.hub_kernels import swap_class
from ..collectives import copy_to_group, reduce_from_group
from ..expert_parallel.experts import dispatch_experts
from ..expert_parallel.over_tensor_parallel import hold_experts_over_tensor_parallel
from ...model.state import own_state, state_of
from ..losses import VocabParallelCausalLMLoss
from .splits import _COLS, LAYOUTS_ATTR, TP_GROUP_ATTR, _rows, _Sliced
from .state_dict import _gather_hook, _slice_hook


class TensorParallelRMSNorm(hf.Qwen3_5RMSNorm):
    """`Qwen3_5RMSNorm` applied to this rank's heads (q_norm/k_norm): replicated weight,
    gradient all-reduced over the tp group. Same arithmetic as Transformers'."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_group(self.weight, getattr(self, TP_GROUP_ATTR))
        output = self._norm(x.float())
        return (output * (1.0 + weight.float())).type_as(x)


class TensorParallelRMSNormGated(hf.Qwen3_5RMSNormGated):
    """GatedDeltaNet's per-head gated norm on this rank's heads (weight replicated,
    gradient all-reduced). Same arithmetic as Transformers'."""

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = copy_to_group(self.weight, getattr(self, TP_GROUP_ATTR))
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = weight * hidden_states.to(input_dtype)
        hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))
        return hidden_states.to(input_dtype)


def check_divisible(config: Any, tp: int) -> None:
    """ValueError naming every head count (and the MLP width; for MoE the experts and the
    shared expert's width) that tp does not divide."""
    counts = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
    }
    if getattr(config, "num_experts", None):  # Qwen3.5-MoE: experts split whole, the shared expert as an MLP
        counts.update(num_experts=config.num_experts, shared_expert_intermediate_size=config.shared_expert_intermediate_size)
    if not getattr(config, "num_experts", None) or getattr(config, "mlp_only_layers", None) or getattr(
            config, "decoder_sparse_step", 1) != 1:  # dense MLPs (Qwen3-Next's mlp_only_layers too)
        counts["intermediate_size"] = config.intermediate_size
    bad = {name: n for name, n in counts.items() if n % tp}
    if bad:
        common = math.gcd(*counts.values())
        sizes = [d for d in range(1, common + 1) if common % d == 0]
        raise ValueError(
            "tensor parallelism splits whole heads: tp size "
            f"{tp} must divide " + ", ".join(f"{name} = {n}" for name, n in bad.items())
            + f"; this model takes tp sizes {sizes} (parallelism_config_tp_size)"
        )


def check_no_cpu_offload(offload_policy: Any, tp: int) -> None:
    """NotImplementedError for FSDP2's CPU offload under tensor parallelism (tp > 1)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if tp > 1 and isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError(
            f"FSDP2's CPU offload (fsdp_offload_params: true, CPUOffloadPolicy) with tensor parallelism (tp size {tp}) is "
            "not supported for Qwen3.5 by qwen35_accel: offloaded shards and their gradients live on the CPU, and the "
            "tensor-parallel gradient norm, state_dict() and full-checkpoint loading would hand those CPU tensors to the "
            "tp group's collectives, which NCCL runs on GPU tensors only. Turn fsdp_offload_params off, or use tp size 1 "
            "with offload."
        )


def _layouts(layer: nn.Module, config: Any) -> dict[str, _Sliced]:
    """{parameter path inside the decoder layer: how it is split} for one layer (a MoE layer: the
    shared expert as the dense MLP; the routed experts whole, `num_experts / tp` consecutive ones
    per rank: their weights' first dim split as rows)."""
    mlp, width = ("mlp.shared_expert", config.shared_expert_intermediate_size) if _is_moe(layer) else ("mlp", config.intermediate_size)
    out: dict[str, _Sliced] = {f"{mlp}.gate_proj.weight": _rows(width),
                               f"{mlp}.up_proj.weight": _rows(width),
                               f"{mlp}.down_proj.weight": _COLS}
    if _is_moe(layer):
        out.update({"mlp.experts.gate_up_proj": _rows(config.num_experts), "mlp.experts.down_proj": _rows(config.num_experts)})
    if layer.block_type == "linear_attention":
        gdn = layer.linear_attn
        qkv = [gdn.key_dim, gdn.key_dim, gdn.value_dim]
        if hasattr(gdn, "in_proj_qkvz"):  # Qwen3-Next: rows laid out per key-head group, so a rank's rows are one block
            out.update({"linear_attn.in_proj_qkvz.weight": _rows(gdn.in_proj_qkvz.weight.shape[0]),
                        "linear_attn.in_proj_ba.weight": _rows(gdn.in_proj_ba.weight.shape[0])})
        else:
            out.update({"linear_attn.in_proj_qkv.weight": _rows(*qkv),
                        "linear_attn.in_proj_z.weight": _rows(gdn.value_dim),
                        "linear_attn.in_proj_b.weight": _rows(gdn.num_v_heads),
                        "linear_attn.in_proj_a.weight": _rows(gdn.num_v_heads)})
        out.update({
            "linear_attn.conv1d.weight": _rows(*qkv),
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


class TensorParallelReplicatedLinear(nn.Linear):
    """A LoRA factor kept whole beside a split base layer (`lora_A` of a row-split base,
    `lora_B` of a column-split one): used on this rank's share of the work, so its gradient
    is all-reduced over the tp group, as the TP norms' weights are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = getattr(self, TP_GROUP_ATTR)
        bias = copy_to_group(self.bias, group) if self.bias is not None else None
        return nn.functional.linear(x, copy_to_group(self.weight, group), bias)


def _is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer: the wrapped `base_layer` and the adapters' `lora_A`/`lora_B`."""
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def _with_adapters(layer: nn.Module, layouts: dict[str, _Sliced]) -> tuple[dict[str, _Sliced], list[nn.Module]]:
    """`layouts` for a layer whose linear layers PEFT may have wrapped: each wrapped base
    weight under `….base_layer.…`, and its adapters split consistently with it (a row-split
    base: `lora_B` by the same rows, `lora_A` whole; a column-split base: `lora_A` by the same
    columns, `lora_B` whole). Returns the layouts and the factors kept whole."""
    out: dict[str, _Sliced] = {}
    whole: list[nn.Module] = []
    for path, sliced in layouts.items():
        owner_path, _, name = path.rpartition(".")
        owner = layer.get_submodule(owner_path)
        if not hasattr(owner, "base_layer"):
            out[path] = sliced
            continue
        what = f"{type(layer).__name__}.{owner_path} ({type(owner).__name__})"
        if not _is_lora_layer(owner):
            raise NotImplementedError(f"tensor parallelism of PEFT layers other than LoRA is not supported: {what}")
        out[f"{owner_path}.base_layer.{name}"] = sliced
        if name != "weight":
            continue
        for adapter in owner.lora_A:
            if getattr(owner, "use_dora", {}).get(adapter, False):
                raise NotImplementedError(f"DoRA under tensor parallelism is not supported (adapter {adapter!r} of {what})")
            if owner.lora_B[adapter].bias is not None:
                raise NotImplementedError(f"LoRA with lora_bias under tensor parallelism is not supported (adapter {adapter!r} of {what})")
            if sliced.kind == "rows":
                out[f"{owner_path}.lora_B.{adapter}.weight"] = sliced
                whole.append(owner.lora_A[adapter])
            else:
                out[f"{owner_path}.lora_A.{adapter}.weight"] = _COLS
                whole.append(owner.lora_B[adapter])
    return out, whole


def _input_hook(group: dist.ProcessGroup) -> Callable[..., Any]:
    """A block's forward pre-hook: f on its input (`hidden_states`, or the first argument)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = copy_to_group(kwargs["hidden_states"], group)
        else:
            args = (copy_to_group(args[0], group), *args[1:])
        return args, kwargs

    return hook


def _output_hook(group: dist.ProcessGroup) -> Callable[..., Any]:
    """A block's forward hook: g on its output (the first element of a tuple)."""

    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (reduce_from_group(output[0], group), *output[1:])
        return reduce_from_group(output, group)

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
    setattr(module, LAYOUTS_ATTR, layouts)
    module.register_state_dict_post_hook(_gather_hook(layouts, group))
    module.register_load_state_dict_pre_hook(_slice_hook(layouts, group))
    setattr(module, TP_GROUP_ATTR, group)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, parts: Qwen35Parts | None = None,
                          ep_mesh: DeviceMesh | None = None, expert_compute_dtype: torch.dtype | None = None) -> int:
    """Split a Qwen3.5 model's decoder layers by heads over `tp_mesh`, in place (MoE: the shared
    expert as the dense MLP, the routed experts whole over the tp ranks, `expert_parallel.dispatch_experts`;
    with `ep_mesh`, the dense FSDP2 mesh, each tp rank's experts split over it too and reached by
    all-to-all: `expert_parallel.over_tensor_parallel`, computing in `expert_compute_dtype`).

    PEFT LoRA layers are split with their base (`_with_adapters`); DoRA, `lora_bias` and
    other PEFT tuners raise NotImplementedError naming the layer.
    Preconditions: fp32 gate holders installed; not yet sharded by FSDP2; the same
    weights on every tp rank (they are sliced, not communicated). Creates new Parameter
    objects: build the optimizer afterwards. Returns the number of layers split. `parts`:
    `model`'s, when the caller located them already (`PARALLELIZER.apply`).
    Raises ValueError naming every head count the tp size does not divide.
    """
    parts = parts or qwen35_parts(model, families=FAMILIES)
    config = model.config.get_text_config()
    tp = tp_mesh.size()
    group = tp_mesh.get_group()
    check_divisible(config, tp)
    for layer in parts.decoder_layers:
        layouts, whole = _with_adapters(layer, _layouts(layer, config))
        _split_module(layer, layouts, tp_mesh)
        for factor in whole:
            if type(factor) is not nn.Linear:
                raise NotImplementedError(f"a LoRA factor of type {type(factor).__name__} under tensor parallelism")
            swap_class(factor, TensorParallelReplicatedLinear)
            setattr(factor, TP_GROUP_ATTR, group)
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
            # The MoE family's and Qwen3-Next's norms are the dense ones' code (tests/test_moe.py, test_qwen3_next.py).
            gated = isinstance(norm, (hf.Qwen3_5RMSNormGated, hf_moe.Qwen3_5MoeRMSNormGated, hf_next.Qwen3NextRMSNormGated))
            swap_class(norm, TensorParallelRMSNormGated if gated else TensorParallelRMSNorm)
            setattr(norm, TP_GROUP_ATTR, group)
        # A MoE layer's f/g wrap the shared expert only: its router and the shared expert's gate run
        # whole on every rank (full gradients), its routed experts are split whole (`_split_experts`).
        mlp = layer.mlp.shared_expert if _is_moe(layer) else layer.mlp
        for block in (mixer, mlp):
            block.register_forward_pre_hook(_input_hook(group), with_kwargs=True)
            block.register_forward_hook(_output_hook(group), with_kwargs=True)
        if _is_moe(layer):
            # The routed experts whole over the tp ranks, which hold the same tokens: each runs its
            # experts (sliced above: plain tensors like every TP slice here, so the gradient norm,
            # checkpoints and FSDP2 units treat them as the others) on all of them, the routes to
            # other ranks' masked, and Transformers' AllReduceEP sums the outputs with one
            # all-reduce (in backward the tokens' and routing weights' gradients); the output
            # enters the layer whole, as the router's.
            experts = layer.mlp.experts
            experts.num_experts //= tp
            experts._is_expert_parallel = True  # Transformers' flag: the experts forward masks other ranks' routes
            if ep_mesh is None:
                dispatch_experts(experts, tp_mesh, batch=tp_mesh, implementation="all_reduce")
            else:
                hold_experts_over_tensor_parallel(experts, ep_mesh, tp_mesh, compute_dtype=expert_compute_dtype)
    return len(parts.decoder_layers)


def _is_moe(layer: nn.Module) -> bool:
    """A Qwen3.5-MoE decoder layer: its MLP is a sparse block (router, routed experts, shared expert)."""
    return hasattr(getattr(layer, "mlp", None), "experts")


# ------------------------------------------------------------------ vocab-parallel lm_head


def check_vocab_parallel(model: nn.Module, tp: int, *, parts: Qwen35Parts | None = None) -> None:
    """ValueError if the lm_head cannot be split by vocab over `tp` ranks (tied to the
    input embedding, or a vocab size tp does not divide); NotImplementedError for Qwen3.5-MoE.
    `parts`: `model`'s, when the caller located them already."""
    parts = parts or qwen35_parts(model, families=FAMILIES)
    if parts.family in ("moe", "next"):
        raise NotImplementedError(
            "a vocab-parallel lm_head is not built for the MoE models (Qwen3.5-MoE, Qwen3-Next) (the router's loss beside the vocab slices); "
            "leave QWEN35_ACCEL_VOCAB_PARALLEL_LM_HEAD / vocab_parallel_lm_head off"
        )
    weight = parts.lm_head.weight
    if weight is parts.embed_tokens.weight:
        raise ValueError(
            "a vocab-parallel lm_head needs untied embeddings (tie_word_embeddings=False): the input embedding "
            "shares its weight and stays replicated"
        )
    if weight.shape[0] % tp:
        raise ValueError(f"a vocab-parallel lm_head needs tp size {tp} to divide the vocab size {weight.shape[0]}")


def apply_vocab_parallel_lm_head(model: nn.Module, tp_mesh: DeviceMesh, *, parts: Qwen35Parts | None = None) -> None:
    """Split the lm_head by vocab rows over `tp_mesh` and install `VocabParallelCausalLMLoss`.

    Each rank computes logits for its V / tp vocab entries only ([…, V / tp], what the
    model returns as `logits`: `gather_vocab_parallel_logits` assembles them) and the
    loss combines the slices without gathering them: the lm_head's activations and the
    loss's fp32 logits shrink by tp. The state dict keeps the full Transformers layout.
    Preconditions: as `apply_tensor_parallel`; see `check_vocab_parallel`. `parts`: `model`'s,
    when the caller located them already.
    """
    parts = parts or qwen35_parts(model, families=FAMILIES)
    check_vocab_parallel(model, tp_mesh.size(), parts=parts)
    if hasattr(parts.lm_head, "base_layer"):
        raise NotImplementedError("a vocab-parallel lm_head wrapped by PEFT (LoRA on the lm_head) is not supported; "
                                  "leave the lm_head out of target_modules or vocab_parallel_lm_head off")
    group = tp_mesh.get_group()
    lm_head = parts.lm_head
    _split_module(lm_head, {name: _rows(p.shape[0]) for name, p in lm_head.named_parameters(recurse=False)}, tp_mesh)
    lm_head.register_forward_pre_hook(_input_hook(group), with_kwargs=True)
    model.register_forward_pre_hook(_refuse_generation, with_kwargs=True)
    own_state(model).vocab_group = group
    model.loss_function = VocabParallelCausalLMLoss(group)


def _refuse_generation(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Generation (`generate` asks for the last position's logits: `logits_to_keep`) would
    sample from this rank's vocab slice: refused, on every rank of the tp group alike."""
    keep = kwargs.get("logits_to_keep", 0)
    if (isinstance(keep, int) and keep != 0) or (torch.is_tensor(keep) and keep.numel() > 0):
        raise NotImplementedError(
            "generation (a forward with logits_to_keep, as generate() calls it) with a vocab-parallel lm_head would "
            "sample from this rank's slice of the vocabulary; generate with vocab_parallel_lm_head off "
            "(QWEN35_ACCEL_VOCAB_PARALLEL_LM_HEAD=0)"
        )


@torch.no_grad()
def gather_vocab_parallel_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The full-vocab logits from this rank's slice (collective over tp; no autograd).
    Returns `logits` unchanged if the model's lm_head is not vocab-parallel."""
    group = state_of(model).vocab_group
    if group is None:
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
