"""DeepSpeed's own checkpoints (`engine.save_checkpoint` / `load_checkpoint`: the Trainer's periodic
checkpoints and its resume) with the GatedDeltaNet gates kept outside the engine: their fp32 values and
their optimizer's state ride in the checkpoint's model-states file under one client-state key, and the
gate keys are listed with the buffers so DeepSpeed's `zero_to_fp32` writes them (fp32)."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

from ...model.gate_holder import GATE_PARAM_NAMES, hidden_holder
from .engine_steps import gates_of_engine
from .gates import gates_state, load_gates_state

# The client-state key of the gates in DeepSpeed's model-states file (`mp_rank_00_model_states.pt`).
CHECKPOINT_KEY = "qwen35_accel_gates"


def save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """`DeepSpeedEngine.save_checkpoint`: the gates' fp32 values and optimizer state added to the
    client state (the same on every data-parallel rank; DeepSpeed writes rank 0's)."""

    @functools.wraps(original)
    def wrapper(self: Any, save_dir: Any, tag: Any = None, client_state: dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        gates = gates_of_engine(self, trained_only=False)
        if gates is not None:
            client_state = {**(client_state or {}), CHECKPOINT_KEY: gates_state(gates)}
        return original(self, save_dir, tag, client_state if client_state is not None else {}, *args, **kwargs)

    return wrapper


def load_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """`DeepSpeedEngine.load_checkpoint`: the gates' fp32 values and optimizer state restored from the
    client state (and taken out of what it returns); a checkpoint without them (a run without the
    plugin) leaves the values its module states gave the holders, their optimizer fresh, with a warning."""

    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        load_path, client_state = original(self, *args, **kwargs)
        gates = gates_of_engine(self, trained_only=False)
        saved = client_state.pop(CHECKPOINT_KEY, None) if isinstance(client_state, dict) else None
        if gates is None or load_path is None:
            return load_path, client_state
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        with_optimizer = bool(call.arguments.get("load_optimizer_states", True)) and not call.arguments.get("load_module_only", False)
        if saved is not None:
            load_gates_state(gates, saved, with_optimizer=with_optimizer)
        elif gates.optimizer is not None and with_optimizer:
            warnings.warn(
                f"{load_path}: a DeepSpeed checkpoint without qwen35_accel's fp32 gate state (saved without the plugin): "
                "the GatedDeltaNet gates take the values of its module states, their fp32 optimizer starts afresh",
                stacklevel=2,
            )
        return load_path, client_state

    return wrapper


def get_buffer_names(original: Callable[..., Any]) -> Callable[..., Any]:
    """`DeepSpeedEngine._get_buffer_names` (the names `zero_to_fp32` restores from the module states):
    the gates kept outside the engine listed too, so the consolidated fp32 state dict has them."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        names = original(self, *args, **kwargs)
        if gates_of_engine(self, trained_only=False) is None:
            return names
        for name, module in self.module.named_modules():
            if hidden_holder(module) is not None:
                names.extend(f"{name}.{gate}" if name else gate for gate in GATE_PARAM_NAMES)
        return names

    return wrapper
