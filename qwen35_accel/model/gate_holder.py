"""The fp32 holder of a GatedDeltaNet's decay-gate parameters, and its checkpoint names.

`Fp32GateParams` holds `A_log` and `dt_bias` in fp32 (an FSDP2 unit of its own under the
parallelizer) and computes the gate; `transformers_name` and the two state-dict hooks keep the
Transformers keys (`…linear_attn.A_log`) in and out of checkpoints. The layer that uses it:
`model.fp32_gate`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HOLDER_NAME = "_fp32_params"
GATE_PARAM_NAMES = ("A_log", "dt_bias")


class GateInput:
    """The holder's input `a` in a wrapper FSDP2 does not look into (it traverses only
    tensors, dicts, lists, tuples and dataclasses).

    FSDP2 runs a unit's post-backward, its gradient reduce-scatter, once the gradients of
    the tensors its forward received exist. For the holder that is mid-way through its
    layer's backward: one more point per layer where ranks wait for each other (gloo
    collectives are synchronous; 2-3% of a small model's step on CPU). Given no tensor,
    FSDP2 reduces the holder from its end-of-backward callback, after the other units.
    Autograd is unaffected: gradients still flow to `a`.
    """

    __slots__ = ("a",)

    def __init__(self, a: torch.Tensor) -> None:
        self.a = a


class Fp32GateParams(nn.Module):
    """Holds `A_log` and `dt_bias` ([num_v_heads], fp32) and computes the decay gate.

    Storage stays fp32 under `module.to(dtype)` / `.half()` / `.bfloat16()`: dtype casts
    skip these two parameters (device moves apply as usual).
    """

    def __init__(self, A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
        super().__init__()
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias)):
            # The same Parameter objects move in (upcast in place if needed), so optimizers
            # and Accelerate's parameter bookkeeping made before the surgery stay valid.
            param = value if isinstance(value, nn.Parameter) else nn.Parameter(value.detach(), requires_grad=value.requires_grad)
            if param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)
            self.register_parameter(name, param)

    def forward(self, a: torch.Tensor | GateInput) -> torch.Tensor:
        """`a`: [batch, seq, num_v_heads], any float dtype (or wrapped in `GateInput`)
        -> g: same shape, fp32.

        Same expression as Transformers' GatedDeltaNet (bitwise equal for fp32 params).
        """
        if isinstance(a, GateInput):
            a = a.a
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # Let `fn` move the parameters (device, meta, to_empty), then undo any dtype cast
        # by recomputing from the fp32 original: no bf16 round trip ever touches them.
        # `detach()` keeps the old storage alive: `_apply` may swap `param.data` in place.
        originals = {name: p.detach() for name, p in self._parameters.items() if p is not None}
        super()._apply(fn, recurse)
        for name, before in originals.items():
            after = self._parameters[name]
            if after is not None and after.dtype != torch.float32 and before.dtype == torch.float32:
                with torch.no_grad():
                    after.data = before.to(device=after.device)
        return self


def transformers_name(name: str) -> str:
    """A parameter's (or state-dict key's) name as the unmodified Transformers model has it:
    `….linear_attn._fp32_params.A_log` -> `….linear_attn.A_log`; other names unchanged."""
    return name.replace(f".{HOLDER_NAME}.", ".")


def hidden_holder(module: nn.Module) -> nn.Module | None:
    """The holder kept outside the module tree (under DeepSpeed: `integrations/deepspeed/gates.py`), or None."""
    holder = module.__dict__.get(HOLDER_NAME)
    return holder if isinstance(holder, nn.Module) else None


def _gate_state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """`prefix._fp32_params.A_log` -> `prefix.A_log` (the Transformers key); a holder kept outside the
    module tree adds its values under those keys."""
    if (holder := hidden_holder(module)) is not None:
        for name in GATE_PARAM_NAMES:
            state_dict[f"{prefix}{name}"] = getattr(holder, name).detach()
        return
    for name in GATE_PARAM_NAMES:
        key = f"{prefix}{HOLDER_NAME}.{name}"
        if key in state_dict:
            state_dict[f"{prefix}{name}"] = state_dict.pop(key)


def _gate_load_state_dict_pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Accept the Transformers keys `prefix.A_log` / `prefix.dt_bias` when loading; a holder kept outside
    the module tree takes their values here (fp32)."""
    if (holder := hidden_holder(module)) is not None:
        for name in GATE_PARAM_NAMES:
            if (value := state_dict.pop(f"{prefix}{name}", None)) is not None:
                with torch.no_grad():
                    getattr(holder, name).copy_(value)
        return
    for name in GATE_PARAM_NAMES:
        key = f"{prefix}{name}"
        if key in state_dict:
            state_dict[f"{prefix}{HOLDER_NAME}.{name}"] = state_dict.pop(key)
