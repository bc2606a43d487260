"""The GatedDeltaNet layer that takes its decay gate from an fp32 holder (`model.gate_holder`).

`A_log` and `dt_bias` define the per-head decay `g = -exp(A_log) * softplus(a + dt_bias)`.
They must be stored and used in fp32: bf16 rounding of `A_log` shifts the decay rate of
every token, and the recurrence compounds it over the sequence. FSDP2 needs each unit's
trainable parameters to share one storage dtype and computes a unit in one `param_dtype`,
so the two parameters move into a submodule of their own, `_fp32_params`, which FSDP2 can
shard as its own fp32 unit while the rest of the layer runs under the user's policy.

Checkpoints keep the Transformers layout: `state_dict()` (and so `save_pretrained`)
emits `…linear_attn.A_log` / `…linear_attn.dt_bias` in fp32, and `load_state_dict`
accepts those names (from unmodified checkpoints, in any floating dtype).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf_qwen4

from ..ops.causal_conv import fla_conv_kernel
from ..ops.documents import per_document
from .checkpoint_gates import restore_checkpoint_gates
from .gate_holder import (  # noqa: F401  (re-exported: the names the package's other modules import from here)
    GATE_PARAM_NAMES,
    HOLDER_NAME,
    Fp32GateParams,
    GateInput,
    _gate_load_state_dict_pre_hook,
    _gate_state_dict_post_hook,
    transformers_name,
)
from .detect import is_sequence_classifier, unwrap_qwen35
from .hub_kernels import swap_class, turn_off_hub_kernels
from .kernel_functions import kernel_function as _kernel
from .kernel_functions import varlen_kernel as _varlen_kernel
from .packing import install_packing_hook
from .state import own_state

# Transformers >= 5.25 splits off the tokens whose states a cache recording its past keeps (assisted
# decoding), none by default, and runs the chunked rule on the rest: the same ops here, so the
# layer stays bitwise Transformers' (the split changes the gradients' layout, hence their rounding).
KEEPS_STATES = hasattr(Cache, "get_recurrent_states_to_keep")

COMPILED_STEPS_ATTR = "_qwen35_compiled_steps"  # {"project"|"output"|"mix": compiled step}, by parallel.regional_compile


class Fp32GateGatedDeltaNet(hf.Qwen3_5GatedDeltaNet):
    """Qwen3_5GatedDeltaNet whose decay gate comes from its `_fp32_params` holder.

    Instances are made by `install_fp32_gate` (class swap on the existing module; no new
    weights). `A_log` / `dt_bias` remain readable as attributes (they resolve to the
    holder), so Transformers' weight init and torch's distributed checkpoint FQN walk
    keep working.
    """

    @property
    def A_log(self) -> nn.Parameter:  # noqa: N802 (Transformers' name)
        return getattr(self, HOLDER_NAME).A_log

    @property
    def dt_bias(self) -> nn.Parameter:
        return getattr(self, HOLDER_NAME).dt_bias

    def __setattr__(self, name: str, value: Any) -> None:
        # Transformers' loader sets each loaded parameter on its module by name
        # (`setattr(linear_attn, "A_log", Parameter)`, core_model_loading.set_param_for_module):
        # the gates land in the holder, still fp32 (a lower dtype would round them silently).
        if name in GATE_PARAM_NAMES and HOLDER_NAME in self.__dict__.get("_modules", {}):
            if isinstance(value, torch.Tensor) and value.dtype != torch.float32:
                raise TypeError(f"{name} of a GatedDeltaNet with an fp32 gate holder must be fp32, got {value.dtype}")
            setattr(self._modules[HOLDER_NAME], name, value)
            return
        super().__setattr__(name, value)

    def _fqn_modifiers(self) -> dict[str, str]:
        # torch.distributed.checkpoint.state_dict: `A_log` in a state-dict key lives on
        # the `_fp32_params` child (which state-dict keys do not show).
        return {name: HOLDER_NAME for name in GATE_PARAM_NAMES}

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Any | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Transformers' GatedDeltaNet forward with `g = self._fp32_params(a)`.

        `hidden_states`: [batch, seq, hidden]; returns [batch, seq, hidden]. The one
        GatedDeltaNet forward of the package: the causal conv (`conv`) and the gated delta
        rule (`core`) are the steps a subclass replaces (the CP layer runs both across
        ranks); everything else is Transformers' layer, op for op.
        """
        if "cache_params" in kwargs:  # the deprecated name Transformers still accepts
            cache = kwargs.pop("cache_params")
        self.check_call(cache, kwargs)
        # torch.compile'd per layer (`parallel.regional_compile`): the steps before and after the
        # gate holder, whose FSDP2 hooks stay outside every compiled region.
        steps = self.__dict__.get(COMPILED_STEPS_ATTR) or {}
        mixed_qkv, z, beta, a = steps.get("project", self._project)(hidden_states, attention_mask)
        g = self.gate(a)
        if "mix" in steps and kwargs.get("cu_seq_lens_q") is None:
            if cache is None:
                return steps["mix"](mixed_qkv, z, g, beta, None, kwargs)
            if self._fresh(cache):  # training's default: `use_cache` True, an empty cache to fill
                out, state = steps["prefill"](cache.update_conv_state(mixed_qkv, self.layer_idx, conv_kernel_size=self.conv_kernel_size),
                                              z, g, beta, kwargs)
                cache.update_recurrent_state(state, self.layer_idx)
                return out
        return self._mix(mixed_qkv, z, g, beta, cache, kwargs, output=steps.get("output"))

    def _fresh(self, cache: Any) -> bool:
        """Whether `cache` holds nothing for this layer yet and records no per-token states: the
        layer's forward is then `_prefill` between the cache's two updates."""
        return (cache.get_conv_state(self.layer_idx) is None and cache.get_recurrent_state(self.layer_idx) is None
                and not cache.is_recording_past(self.layer_idx))

    def _prefill(
        self, mixed_qkv: torch.Tensor, z: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_mix` from zero states with the rule's final state kept: the output [batch, seq, hidden]
        and the state [batch, v_heads, k_dim, v_dim] a fresh cache stores (the eager path's ops:
        the conv of a fresh cache convolves `mixed_qkv` as it is)."""
        query, key, value = self._split_heads(self.conv(mixed_qkv, None, kwargs).transpose(1, 2))
        rule = _kernel("torch_chunk_gated_delta_rule", "fla", query)
        out, state = rule(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, **kwargs)
        return self._gated_output(out, z), state

    def _mix(
        self,
        mixed_qkv: torch.Tensor,
        z: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cache: Any | None,
        kwargs: dict[str, Any],
        output: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The causal conv, the gated delta rule and the gated output (`output`, default
        `_gated_output`): `_project`'s mixed_qkv and z, the gate g, beta -> [batch, seq, hidden]."""
        mixed_qkv = self.conv(mixed_qkv, cache, kwargs)
        query, key, value = self._split_heads(mixed_qkv.transpose(1, 2))
        core_attn_out = self.core(query, key, value, g, beta, cache, kwargs)
        return (output or self._gated_output)(core_attn_out, z)

    def _project(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padding zeroed, then the input projections: [batch, seq, hidden] -> (mixed_qkv
        [batch, conv_dim, seq], z [batch, seq, v_heads, v_dim], beta and a [batch, seq, v_heads])."""
        hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
        batch_size, seq_len, _ = hidden_states.shape
        mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)
        z = self.in_proj_z(hidden_states).reshape(batch_size, seq_len, -1, self.head_v_dim)
        beta = self.in_proj_b(hidden_states).sigmoid()
        return mixed_qkv, z, beta, self.in_proj_a(hidden_states)

    def check_call(self, cache: Any | None, kwargs: dict[str, Any]) -> None:
        """Refuse what this layer cannot compute (nothing here; the CP layer refuses caches)."""

    def conv(self, mixed_qkv: torch.Tensor, cache: Any | None, kwargs: dict[str, Any]) -> torch.Tensor:
        """Depthwise causal conv + activation: [batch, conv_dim, seq] -> the same shape.

        Transformers' kernels, looked up on its module at call time (torch fallback or
        causal-conv1d; FLA's Triton conv instead of the torch one where usable: `_kernel`),
        with the cache's conv state when one is given.
        """
        seq_len = mixed_qkv.shape[-1]
        weight = self.conv1d.weight.squeeze(1)
        documents = kwargs.get("cu_seq_lens_q")
        if documents is not None and cache is None and _varlen_kernel("causal_conv1d", mixed_qkv):
            conv = _kernel("causal_conv1d_fn", "causal_conv1d", mixed_qkv)
            if conv is fla_conv_kernel:  # FLA takes the documents' offsets as they come: no seq_idx round trip
                return conv(mixed_qkv, weight, self.conv1d.bias, activation=self.activation, cu_seqlens=documents)
            batch = mixed_qkv.shape[0]
            index = torch.arange(batch * seq_len, device=documents.device)
            seq_idx = (torch.searchsorted(documents[1:-1].long(), index, right=True)).view(batch, seq_len).to(torch.int32)
            return conv(mixed_qkv, weight, self.conv1d.bias, activation=self.activation, seq_idx=seq_idx)
        if documents is not None and cache is None:  # packed rows: each document's window starts at its start
            batch, channels = mixed_qkv.shape[:2]
            flat = mixed_qkv.transpose(1, 2).reshape(batch * seq_len, channels)

            def conv_alone(x: torch.Tensor) -> torch.Tensor:  # [n, P, channels] -> [n, P, channels]
                out = _kernel("causal_conv1d_fn", "causal_conv1d", x)(x.transpose(1, 2), weight, self.conv1d.bias, activation=self.activation)
                return out.transpose(1, 2)

            out = per_document(conv_alone, [flat], documents)
            return out.view(batch, seq_len, channels).transpose(1, 2)
        conv_state = cache.get_conv_state(self.layer_idx, state_idx=0) if cache is not None else None
        if conv_state is not None and seq_len == 1 and not cache.is_recording_past(self.layer_idx):
            if hasattr(cache, "increase_count"):  # Transformers >= 5.25: linear layers count their tokens
                cache.increase_count(self.layer_idx, 0)
            update = _kernel("causal_conv1d_update", "causal_conv1d", mixed_qkv)
            return update(mixed_qkv, conv_state, weight, self.conv1d.bias, self.activation)
        if cache is not None:
            mixed_qkv = cache.update_conv_state(mixed_qkv, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        out = _kernel("causal_conv1d_fn", "causal_conv1d", mixed_qkv)(mixed_qkv, weight, self.conv1d.bias, activation=self.activation, **kwargs)
        return out[:, :, -seq_len:] if cache is not None else out

    def core(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cache: Any | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """The gated delta rule: query, key [batch, seq, k_heads, k_dim], value [batch, seq,
        v_heads, v_dim], g (fp32), beta [batch, seq, v_heads] -> [batch, seq, v_heads, v_dim].

        Transformers' chunked rule (the recurrent one for single-token decoding with a
        cache), from and into the cache's recurrent state when one is given.
        """
        documents = kwargs.pop("cu_seq_lens_q", None)
        if documents is not None and cache is None and _varlen_kernel("fla", query):
            batch, seq_len = query.shape[:2]
            flat = [t.reshape(1, batch * seq_len, *t.shape[2:]) for t in (query, key, value, g, beta)]
            out, _ = hf.torch_chunk_gated_delta_rule(
                *flat[:3], g=flat[3], beta=flat[4], use_qk_l2norm_in_kernel=True, cu_seqlens=documents
            )
            return out.view(batch, seq_len, *value.shape[2:])
        if documents is not None and cache is None:  # packed rows: each document from a zero state
            batch, seq_len = query.shape[:2]

            def rule_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return _kernel("torch_chunk_gated_delta_rule", "fla", q)(q, k, v, g=g_, beta=b, use_qk_l2norm_in_kernel=True)[0]

            flat = [t.reshape(batch * seq_len, *t.shape[2:]) for t in (query, key, value, g, beta)]
            return per_document(rule_alone, flat, documents).view(batch, seq_len, *value.shape[2:])
        recurrent_state = cache.get_recurrent_state(self.layer_idx, state_idx=0) if cache is not None else None
        seq_len = query.shape[1]
        single = recurrent_state is not None and seq_len == 1
        if KEEPS_STATES and not single:
            keep = min(cache.get_recurrent_states_to_keep(self.layer_idx), seq_len) if cache is not None else 0
            out, state = self._rule_keeping_states(query, key, value, g, beta, recurrent_state, keep, cache is not None,
                                                   documents, kwargs)
            if cache is not None:
                cache.update_recurrent_state(state, self.layer_idx)
            return out
        name = "torch_recurrent_gated_delta_rule" if single else "torch_chunk_gated_delta_rule"
        rule = _kernel(name, "fla", query)
        core_attn_out, last_recurrent_state = rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=recurrent_state,
            output_final_state=cache is not None,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=documents,
            **kwargs,
        )
        if cache is not None:
            cache.update_recurrent_state(last_recurrent_state, self.layer_idx)
        return core_attn_out

    def _rule_keeping_states(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None,
        keep: int,
        final_state: bool,
        documents: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor | list[torch.Tensor] | None]:
        """Transformers >= 5.25's rule: the chunked rule over all but the last `keep` tokens, then
        the recurrent rule token by token. The output [batch, seq, v_heads, v_dim] and the final
        state (if `final_state`: a cache takes it), or with `keep` the state after each of the last
        `keep` tokens (a cache recording its past crops rejected candidate tokens with them)."""
        split = query.shape[1] - keep
        heads, tails = zip(*(torch.tensor_split(t, [split], dim=1) for t in (query, key, value, g, beta)))
        chunk = _kernel("torch_chunk_gated_delta_rule", "fla", query)
        out, state = chunk(*heads[:3], g=heads[3], beta=heads[4], initial_state=initial_state,
                           output_final_state=final_state or keep > 0, use_qk_l2norm_in_kernel=True, cu_seqlens=documents, **kwargs)
        outputs, states = [out], []
        step = _kernel("torch_recurrent_gated_delta_rule", "fla", query)
        for i in range(keep):
            q, k, v, g_i, b = (t[:, i : i + 1] for t in tails)
            out, state = step(q, k, v, g=g_i, beta=b, initial_state=state, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, **kwargs)
            outputs.append(out)
            states.append(state)
        return torch.cat(outputs, dim=1), states or state

    def gate(self, a: torch.Tensor) -> torch.Tensor:
        """g [batch, seq, num_v_heads] fp32 from `a` = in_proj_a(hidden_states).

        Through the holder's forward: under FSDP2 that is what gathers A_log/dt_bias in
        fp32. `GateInput` defers the holder's gradient reduction to the end of backward.
        """
        return getattr(self, HOLDER_NAME)(GateInput(a))

    def _split_heads(self, mixed_qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv [batch, seq, conv_dim] -> query, key [batch, seq, k_heads, k_dim], value [batch, seq, v_heads, v_dim]."""
        batch_size, seq_len, _ = mixed_qkv.shape
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch_size, seq_len, -1, self.head_k_dim)
        key = key.reshape(batch_size, seq_len, -1, self.head_k_dim)
        value = value.reshape(batch_size, seq_len, -1, self.head_v_dim)
        return query, key, value

    def _gated_output(self, core_attn_out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm per head and `out_proj`: [batch, seq, v_heads, v_dim] -> [batch, seq, hidden]."""
        batch_size, seq_len = core_attn_out.shape[:2]
        core_attn_out = self.norm(core_attn_out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core_attn_out.reshape(batch_size, seq_len, -1))


class Fp32GateMoeGatedDeltaNet(Fp32GateGatedDeltaNet, hf_moe.Qwen3_5MoeGatedDeltaNet):
    """The MoE family's GatedDeltaNet with the fp32 gate holder: the dense layer's code, which
    is the MoE layer's own with the class names mapped (`tests/test_moe.py` holds that
    premise: a Transformers release that changes one fails it before any parity drifts)."""


class Fp32GateQwen3NextGatedDeltaNet(Fp32GateGatedDeltaNet, hf_next.Qwen3NextGatedDeltaNet):
    """Qwen3-Next's GatedDeltaNet with the fp32 gate holder: Qwen3.5's layer but for the input
    projections, laid out per key-head group (`in_proj_qkvz`, `in_proj_ba`, split by Transformers'
    `fix_query_key_value_ordering`); the conv, the rule, the gate and the gated output are the same ops."""

    def _project(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `Fp32GateGatedDeltaNet._project`, from Qwen3-Next's projections: (mixed_qkv [batch,
        conv_dim, seq], z [batch, seq, v_heads, v_dim], beta and a [batch, seq, v_heads])."""
        hidden_states = hf_next.apply_mask_to_padding_states(hidden_states, attention_mask)
        query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                                       self.in_proj_ba(hidden_states))
        mixed_qkv = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value)], dim=-1)
        return mixed_qkv.transpose(1, 2), z, b.sigmoid(), a


class Fp32GateQwen4ExpGatedDeltaNet(Fp32GateGatedDeltaNet, hf_qwen4.Qwen4ExpTextGatedDeltaNet):
    """Qwen4-Exp's GatedDeltaNet with the fp32 gate holder: Qwen3.5's layer (the same projections and ops;
    its gated norm's activation is its config's), the Qwen4-Exp class kept."""


# Each family's GatedDeltaNet and text decoder, and the fp32-gate class each GatedDeltaNet becomes.
GATED_DELTA_NET_CLASSES: tuple[type[nn.Module], ...] = (
    hf.Qwen3_5GatedDeltaNet, hf_moe.Qwen3_5MoeGatedDeltaNet, hf_next.Qwen3NextGatedDeltaNet,
    hf_qwen4.Qwen4ExpTextGatedDeltaNet,
)
TEXT_MODEL_CLASSES: tuple[type[nn.Module], ...] = (hf.Qwen3_5TextModel, hf_moe.Qwen3_5MoeTextModel, hf_next.Qwen3NextModel)
_FP32_GATE_CLASS: dict[type[nn.Module], type[nn.Module]] = {
    hf.Qwen3_5GatedDeltaNet: Fp32GateGatedDeltaNet,
    hf_moe.Qwen3_5MoeGatedDeltaNet: Fp32GateMoeGatedDeltaNet,
    hf_next.Qwen3NextGatedDeltaNet: Fp32GateQwen3NextGatedDeltaNet,
    hf_qwen4.Qwen4ExpTextGatedDeltaNet: Fp32GateQwen4ExpGatedDeltaNet,
}


def _named_parameters_with_transformers_names(
    self: nn.Module, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in type(self).named_parameters(self, prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate):
        yield transformers_name(name), param


def _below_fp32(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).eps > torch.finfo(torch.float32).eps


def rounded_gate_dtypes(model: nn.Module) -> list[str]:
    """The dtypes below fp32 in which `model`'s GatedDeltaNet layers store `A_log`/`dt_bias`
    (a bf16 load), sorted; empty where they are fp32 (or held by `_fp32_params`). Any device."""
    return sorted({
        str(getattr(module, name).dtype)
        for module in model.modules() if isinstance(module, GATED_DELTA_NET_CLASSES)
        for name in GATE_PARAM_NAMES
        if _below_fp32(getattr(module, name).dtype)
    })


def has_fp32_gate(module: nn.Module) -> bool:
    return isinstance(module, Fp32GateGatedDeltaNet)


def install_fp32_gate(model: nn.Module) -> int:
    """Move every GatedDeltaNet's `A_log` and `dt_bias` into an fp32 `_fp32_params` holder.

    Works on any module tree holding `Qwen3_5GatedDeltaNet` layers (or the MoE family's
    `Qwen3_5MoeGatedDeltaNet`, which become `Fp32GateMoeGatedDeltaNet`), on any device
    (meta included) and before any sharding. Values are converted exactly (upcast to
    fp32); gates loaded in a lower precision (`from_pretrained(..., dtype=torch.bfloat16)`)
    take the checkpoint's fp32 values back when the model's `name_or_path` leads to its
    safetensors files, and warn once otherwise (`restore_checkpoint_gates`; meta tensors
    are left to the rank that broadcasts them). Transformers' Hub kernels are turned off first
    (`hub_kernels.turn_off_hub_kernels`: kernelize's forwards would shadow the swapped classes'). The Parameter objects and
    `requires_grad` are preserved. `model.named_parameters()` then reports them under
    their Transformers names (`…linear_attn.A_log`), like `state_dict()`. Each text decoder
    holding them computes packed rows document by document (`model.packing`); a sequence
    classifier's refuses them (one score per row).
    Idempotent: returns the number of layers converted by this call (0 the second time).
    """
    turn_off_hub_kernels(model)  # before the class swaps: kernelize's instance forwards would outlive them
    converted = 0
    arrived: dict[nn.Module, dict[str, torch.dtype]] = {}  # gates loaded below fp32 precision (not meta)
    for module in model.modules():
        if not isinstance(module, GATED_DELTA_NET_CLASSES) or has_fp32_gate(module):
            continue
        if type(module) not in _FP32_GATE_CLASS:
            raise TypeError(
                f"install_fp32_gate: {type(module).__name__} subclasses Transformers' GatedDeltaNet with its own "
                "forward; converting it would drop that forward. Only the Transformers classes themselves are supported."
            )
        rounded = {
            name: param.dtype
            for name in GATE_PARAM_NAMES
            if (param := module._parameters.get(name)) is not None and not param.is_meta and _below_fp32(param.dtype)
        }
        if rounded:
            arrived[module] = rounded
        A_log = module._parameters.pop("A_log")
        dt_bias = module._parameters.pop("dt_bias")
        module.add_module(HOLDER_NAME, Fp32GateParams(A_log, dt_bias))
        swap_class(module, _FP32_GATE_CLASS[type(module)])
        module.register_state_dict_post_hook(_gate_state_dict_post_hook)
        module.register_load_state_dict_pre_hook(_gate_load_state_dict_pre_hook)
        converted += 1
    if arrived:
        restored = restore_checkpoint_gates(model, arrived)
        if restored:  # for the plugin's prepared line
            own_state(unwrap_qwen35(model)).restored_gates += restored
    one_score_per_row = is_sequence_classifier(model)  # packed rows refused: one score per row
    for module in model.modules():  # every text decoder that holds converted layers
        if isinstance(module, TEXT_MODEL_CLASSES) and any(has_fp32_gate(m) for m in module.modules()):
            install_packing_hook(module, one_score_per_row=one_score_per_row)
    if (converted or any(has_fp32_gate(m) for m in model.modules())) and "named_parameters" not in model.__dict__:
        # One naming everywhere: parameter names match state-dict keys and checkpoints
        # (torch.distributed.checkpoint names optimizer state by `named_parameters()`
        # but loads it by state-dict walk). `get_parameter(name)` resolves them through
        # the A_log / dt_bias attributes of the layer.
        model.named_parameters = types.MethodType(_named_parameters_with_transformers_names, model)  # type: ignore[method-assign]
    return converted
