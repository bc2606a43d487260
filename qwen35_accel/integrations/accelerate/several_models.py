"""Several dense Qwen3.5 models per run: a policy and a frozen reference (DPO, GRPO, distillation).

Stock Accelerate prepares one model per FSDP2 `prepare` call (it raises "Only one model is
supported when using FSDP2"), and TRL wraps its reference model itself (`prepare_fsdp`: one
`fully_shard` on the whole model, so no per-layer units, the gate parameters gathered in the
compute dtype, no CP/TP layers). Here every extra dense Qwen3.5 model is prepared as the
policy is (`prepare_qwen35_fsdp2`: our units, fp32 gate holders, the accelerator's mesh with
its cp/tp layers); the policy (the model whose parameters the optimizer holds) takes the
ordinary path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..targets import is_dense_qwen35_module


def prepare_extra_model(accelerator: Any, model: nn.Module, *, register: bool) -> nn.Module:
    """A dense Qwen3.5 model that no optimizer holds (a frozen reference), prepared as
    `Accelerator.prepare` prepares the policy: fp32 gate holders, then our FSDP2 units (and
    CP/TP layers) on the accelerator's mesh, its storage dtype kept under mixed precision (no
    fp32 master weights: nothing updates them). `register`: added to the accelerator's prepared
    models, as `Accelerator.prepare` does (TRL's `prepare_fsdp` does not)."""
    from ...model.fp32_gate import install_fp32_gate
    from .preparation import prepare_qwen35_fsdp2

    install_fp32_gate(model)
    model = prepare_qwen35_fsdp2(accelerator, model, frozen=True)
    if register and model not in accelerator._models:
        accelerator._models.append(model)
        model._is_accelerate_prepared = True
    return model


def prepare(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Accelerator.prepare` with several dense Qwen3.5 models under FSDP2, or one without an
    optimizer (evaluation only; stock FSDP2 before Accelerate 1.16 refuses a model without its
    optimizer, 1.16 prepares it on its own path, ours is the same on both): the ones
    no optimizer among the arguments holds are prepared by `prepare_extra_model`, the rest
    by the original (one model with its optimizer); results come back in argument order."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, device_placement: Any = None) -> Any:
        indices = [i for i, a in enumerate(args) if isinstance(a, nn.Module)]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        if (
            not indices
            or (len(indices) == 1 and optimizers)  # the ordinary case
            or not getattr(self, "is_fsdp2", False)
            or not all(is_dense_qwen35_module(args[i]) for i in indices)
        ):
            return original(self, *args, device_placement=device_placement)
        optimized = {id(p) for a in optimizers for g in a.param_groups for p in g["params"]}
        policies = [i for i in indices if any(id(p) in optimized for p in args[i].parameters())]
        if len(policies) > 1:
            raise ValueError(
                f"{len(policies)} of the {len(indices)} models passed to prepare have parameters in an optimizer; under "
                "FSDP2 one model trains per prepare call (prepare each trained model with its optimizer separately)"
            )
        extras = [i for i in indices if i not in policies]
        result = list(args)
        for i in extras:
            result[i] = prepare_extra_model(self, args[i], register=True)
        rest = [i for i in range(len(args)) if i not in extras]
        if rest:
            placement = [device_placement[i] for i in rest] if device_placement is not None else None
            prepared = original(self, *(args[i] for i in rest), device_placement=placement)
            prepared = prepared if len(rest) > 1 else (prepared,)
            for i, obj in zip(rest, prepared):
                result[i] = obj
        return tuple(result) if len(result) > 1 else result[0]

    return wrapper
