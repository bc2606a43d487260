"""torch.compile per decoder layer, in the regions that hold no FSDP2 unit boundary.

Compiling a whole FSDP2-sharded model breaks the graph at every unit's hooks (FSDP2 runs them
eagerly), and each GatedDeltaNet layer holds a unit of its own, the fp32 gate holder, in the
middle of its forward. So the compiled regions are the ones between those boundaries (torchtitan
compiles whole blocks before sharding them; here no region holds a unit, so they compile after
the parallelizer as well). In every decoder layer:
- the two RMSNorms and the MLP (`nn.Module.compile`, in place; of a MoE block its shared expert);
- the attention block's forward (its call's hooks stay eager), or under CP, whose attention
  exchanges K/V, its projections and gated output around the exchange;
- the GatedDeltaNet layer's steps before and after the gate (`_project`: padding mask,
  projections, beta; `_gated_output`: gated RMSNorm and `out_proj`), and where they are
  Transformers' torch functions (CPU; no CUDA kernel) and the row is not packed, the causal conv
  and the gated delta rule with the output (`_mix`; `_prefill` when the forward fills a fresh
  cache, as training does with `use_cache` left True), under CP the rule's local chunk summaries
  and reads around the state exchange.
Eager: CUDA kernels (FLA's Triton rule and conv, causal-conv1d: compiled already), packed rows
(their document groups are host-side bookkeeping), CP's collectives, the gate holder, the routed
experts and the router, the loss head. Under tp the same regions compile on the head-parallel
slices.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..model.detect import Qwen35Parts
from ..model.fp32_gate import COMPILED_STEPS_ATTR, has_fp32_gate
from ..model.kernel_functions import kernel_source
from .context_parallel.gated_delta_net import read_halves, summarise_halves


def _torch_kernels(layer: nn.Module) -> bool:
    """Whether `layer`'s conv and chunked rule run Transformers' torch functions on its device
    (CPU, or no usable CUDA kernel): plain torch code that compiles. CUDA kernels (FLA's Triton
    rule and conv, causal-conv1d) are left out of the compiled regions."""
    device = layer.in_proj_qkv.weight.device
    if device.type == "cpu":  # the packages' kernels are CUDA-only: Transformers' torch functions run
        return True
    return all(kernel_source(name, package, str(device)) == "torch"
               for name, package in (("torch_chunk_gated_delta_rule", "fla"), ("causal_conv1d_fn", "causal_conv1d")))


REGION_ATTR = "_qwen35_compiled_region"  # on the modules compiled here (in place, `nn.Module.compile`)


def _compile_module(module: nn.Module, compile_kwargs: dict[str, Any]) -> None:
    module.compile(**compile_kwargs)
    module.__dict__[REGION_ATTR] = True


def compile_layer_regions(parts: Qwen35Parts, *, context_parallel: bool, **compile_kwargs: Any) -> str:
    """Compile the regions of every decoder layer of `parts` (see the module doc) with
    `torch.compile(**compile_kwargs)`, after `PARALLELIZER.apply` (precondition: a GatedDeltaNet
    layer holds its `_fp32_params`, and CP's layers are installed when `context_parallel`).
    Returns what was compiled, in words, for the prepared line."""
    compiled: set[str] = set()
    for layer in parts.decoder_layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            module = getattr(layer, name, None)
            if isinstance(module, nn.Module):
                _compile_module(module, compile_kwargs)
                compiled.add("norms")
        if parts.family == "dense":
            _compile_module(layer.mlp, compile_kwargs)
            compiled.add("MLP")
        else:  # the sparse block routes by data (experts, and the router whose logits a hook records): its shared expert
            _compile_module(layer.mlp.shared_expert, compile_kwargs)
            compiled.add("shared expert")
        attention = getattr(layer, "self_attn", None)
        if isinstance(attention, nn.Module) and not context_parallel:
            # Its forward, not its call: Transformers' output-recorder hooks on attention modules (a
            # MoE model recording router logits) read a ContextVar, which breaks a graph.
            attention.forward = torch.compile(attention.forward, **compile_kwargs)
            attention.__dict__[REGION_ATTR] = True
            compiled.add("attention")
        elif isinstance(attention, nn.Module):  # CP's attention: the steps around its K/V exchange
            attention.__dict__[COMPILED_STEPS_ATTR] = {"cp_project": torch.compile(attention._cp_project, **compile_kwargs),
                                                       "cp_output": torch.compile(attention._cp_output, **compile_kwargs)}
            compiled.add("attention projections and output")
        linear = getattr(layer, "linear_attn", None)
        if linear is not None:
            if not has_fp32_gate(linear):
                raise ValueError(f"compile_layer_regions: {type(linear).__name__} has no fp32 gate holder; install it first")
            steps = {"project": torch.compile(linear._project, **compile_kwargs),
                     "output": torch.compile(linear._gated_output, **compile_kwargs)}
            compiled.add("GatedDeltaNet projections and gated output")
            if not context_parallel and _torch_kernels(linear):
                steps["mix"] = torch.compile(linear._mix, **compile_kwargs)
                steps["prefill"] = torch.compile(linear._prefill, **compile_kwargs)  # `use_cache` left True
                compiled.add("GatedDeltaNet conv and gated delta rule (torch functions)")
            elif context_parallel and _torch_kernels(linear):  # the rule's local steps around the state exchange
                steps["cp_summarise"] = torch.compile(summarise_halves, **compile_kwargs)
                steps["cp_read"] = torch.compile(read_halves, **compile_kwargs)
                compiled.add("GatedDeltaNet chunk summaries and reads (torch functions)")
            linear.__dict__[COMPILED_STEPS_ATTR] = steps
    order = ("norms", "MLP", "shared expert", "attention", "attention projections and output", "GatedDeltaNet projections and gated output",
             "GatedDeltaNet conv and gated delta rule (torch functions)", "GatedDeltaNet chunk summaries and reads (torch functions)")
    return ", ".join(part for part in order if part in compiled)
