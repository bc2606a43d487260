"""The parts of the plugin's prepared line ("… prepared by qwen35_accel: …") that say what runs:
where a MoE model's experts live, the mixed precision in effect and where it came from, the loss,
Transformers' Hub kernels turned off."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import nn


def experts_note(model: nn.Module) -> str:
    """For the prepared line: where a MoE model's routed experts live."""
    from ..model.detect import qwen35_family, unwrap_qwen35
    from ..parallel.expert_parallel.experts import describe_experts

    return f"{describe_experts(unwrap_qwen35(model))}, " if qwen35_family(model) in ("moe", "next", "qwen4") else ""


def hub_kernels_note(model: nn.Module) -> str:
    """For the prepared line: that Transformers' kernelize was turned off, and what it had replaced."""
    from ..model.state import find_state

    state = find_state(model)
    replaced = state.hub_kernels if state is not None else None
    if replaced is None:
        return ""
    had = f"; it had replaced {', '.join(replaced)}" if replaced else ""
    return f", Transformers' Hub kernels (kernelize): off, its forwards would run instead of qwen35_accel's layers{had}"


def mixed_precision_note(mixed_precision: str, policy: Any, environ: Mapping[str, str] | None = None) -> str:
    """For the prepared line: the mixed precision in effect (the Accelerator's), what the units compute
    and reduce in (`policy`: FSDP2's `MixedPrecisionPolicy`), and where it came from when that is not the
    launch config: a script's `TrainingArguments(fp16=True)` / `bf16=True` or `Accelerator(mixed_precision=...)`
    overrides `ACCELERATE_MIXED_PRECISION`, which `accelerate launch` sets from the YAML (`environ`,
    default `os.environ`)."""
    environ = os.environ if environ is None else environ
    param = getattr(policy, "param_dtype", None)
    reduce = getattr(policy, "reduce_dtype", None) or param
    param_name, reduce_name = (str(d).removeprefix("torch.") if d is not None else "their storage dtype" for d in (param, reduce))
    note = f"mixed precision: {mixed_precision} (units compute in {param_name}, reduce in {reduce_name}; gate holders fp32)"
    launched = environ.get("ACCELERATE_MIXED_PRECISION")
    if launched is not None and launched.lower() != str(mixed_precision).lower():
        note += (f", set by the script (TrainingArguments fp16/bf16 or Accelerator(mixed_precision=...)) over the "
                 f"launch config's {launched!r}")
    return note


def replaced_forward(model: nn.Module) -> str | None:
    """The function (`module.qualname`) of a forward set on `model` itself, which runs instead of its
    class's and so computes the loss (Liger's `lce_forward` with the Trainer's `use_liger_kernel`), or
    None. TRL's fused-head forward, which the plugin wraps and which keeps the plugin's loss paths, is
    not such a forward."""
    from .trl.fused_head import FUSED_HEAD_ATTR, is_trl_fused_forward

    forward = model.__dict__.get("forward")
    function = getattr(forward, "__func__", forward)
    if function is None or getattr(function, FUSED_HEAD_ATTR, False) or is_trl_fused_forward(forward):
        return None
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', type(function).__name__)}"


def loss_in_effect(model: nn.Module) -> str:
    """The training loss's path, for the prepared line."""
    from ..model.detect import is_sequence_classifier, is_token_classifier, unwrap_qwen35
    from ..parallel.tiled_loss import tiled_loss_mode

    if is_sequence_classifier(model):
        return "the sequence classifier's (Transformers', on each row's last real token)"
    if is_token_classifier(model):
        return "the token classifier's (Transformers', over the step's labelled tokens)"
    base = unwrap_qwen35(model)
    replaced = replaced_forward(base)
    if replaced is not None:
        who = "Liger's fused linear cross-entropy (use_liger_kernel): " if replaced.startswith("liger_kernel.") else ""
        return f"{who}the forward {replaced} set on the model computes it; the tiled loss does not run"
    mode = tiled_loss_mode(base)
    if mode != "off":
        return f"tiled, {mode} (training forwards return no logits; QWEN35_ACCEL_TILED_LOSS=off for Transformers')"
    return "Transformers' (whole logits)"
