"""DeepSpeed's optimizer step with the GatedDeltaNet gates beside it (`gates.DeepSpeedGates`): the
engine's model step reduces the gates' gradients first and steps their optimizer after DeepSpeed's;
in between, ZeRO's global gradient norm counts them (so its clipping and the logged norm do)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ...model.state import find_state
from .gates import GATE_SQUARED_NORM, DeepSpeedGates


def gates_of_engine(engine: Any, trained_only: bool = True) -> DeepSpeedGates | None:
    """The gates the plugin keeps outside `engine`'s model, or None; `trained_only`: None for frozen gates."""
    state = find_state(getattr(engine, "module", None))
    gates = state.deepspeed_gates if state is not None else None
    if gates is None or (trained_only and gates.optimizer is None):
        return None
    return gates


def take_model_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """`DeepSpeedEngine._take_model_step` (the accumulation boundary's step): the gates' gradients
    averaged over the data-parallel group and their squared norm handed to ZeRO's norm for the
    duration; then the gates' own step with DeepSpeed's clip coefficient and learning rates."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        gates = gates_of_engine(self)
        if gates is None:
            return original(self, *args, **kwargs)
        token = GATE_SQUARED_NORM.set(gates.reduce())
        try:
            result = original(self, *args, **kwargs)
        finally:
            GATE_SQUARED_NORM.reset(token)
        gates.step(self)
        return result

    return wrapper


def _with_gates(norm: torch.Tensor, squared: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """sqrt(norm² + gates² · loss_scale²); an invalid norm (DeepSpeed's -1, inf, NaN) stays as it is."""
    if not bool(torch.isfinite(norm).all()) or bool((norm < 0).any()):
        return norm
    return torch.sqrt(norm.float() ** 2 + squared.to(norm.device) * float(loss_scale) ** 2).to(norm.dtype)


def zero12_scaled_global_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    """`DeepSpeedZeroOptimizer.scaled_global_norm` (ZeRO-1/2): the gates' norm counted in."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        norm = original(self, *args, **kwargs)
        squared = GATE_SQUARED_NORM.get()
        if squared is None:
            return norm
        return _with_gates(torch.as_tensor(norm, dtype=torch.float32), squared, self.loss_scale)

    return wrapper


def zero3_norm_groups(original: Callable[..., Any]) -> Callable[..., Any]:
    """`DeepSpeedZeroOptimizer_Stage3._get_norm_groups` (ZeRO-3): the gates' norm one more group."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        groups = original(self, *args, **kwargs)
        squared = GATE_SQUARED_NORM.get()
        if squared is None:
            return groups
        device = next((g.device for g in groups if torch.is_tensor(g)), squared.device)
        return [*groups, (squared.sqrt() * float(self.loss_scale)).to(device)]

    return wrapper
