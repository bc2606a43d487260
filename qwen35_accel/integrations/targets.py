"""Which prepared objects the patch points act on."""

from __future__ import annotations

from typing import Any

from torch import nn


def prepared_by_accelerate(model: Any) -> bool:
    """Whether the plugin's Accelerate preparation prepared `model` (`parallel.prepared`: its
    `Preparation`, found through DDP's, torch.compile's and PEFT's wrappers)."""
    from ..parallel.prepared import prepared_by_accelerate as prepared

    return prepared(model if isinstance(model, nn.Module) else None)


def accelerator_cp_mesh(accelerator: Any) -> Any:
    """The cp mesh of the Qwen3.5-family models the plugin prepared on `accelerator` (its prepared
    models' state; paused by generation or not), or None: the step's CP context is then Accelerate's."""
    from ..model.state import find_state

    for model in getattr(accelerator, "_models", []):
        state = find_state(model) if isinstance(model, nn.Module) else None
        if state is not None and state.cp_mesh is not None and prepared_by_accelerate(model):
            return state.cp_mesh
    return None


def is_dense_qwen35_module(model: Any) -> bool:
    """A module the plugin takes over (dense Qwen3.5); anything else keeps Accelerate's path."""
    from ..model.detect import is_dense_qwen35

    return isinstance(model, nn.Module) and is_dense_qwen35(model)


def is_qwen35_module(model: Any) -> bool:
    """A Qwen3.5 model of either family (dense or MoE), wrappers looked through."""
    from ..model.detect import qwen35_family

    return isinstance(model, nn.Module) and qwen35_family(model) is not None


def is_plugin_fsdp2_module(model: Any, accelerator: Any) -> bool:
    """A module the plugin's FSDP2 preparation (and CP, TP) takes over: a Qwen3.5 model of either
    family, under any layout. Anything else: Accelerate's."""
    return is_qwen35_module(model)


def the_model(args: tuple[Any, ...]) -> nn.Module | None:
    """The one module among a prepare call's arguments, or None for zero or several."""
    models = [a for a in args if isinstance(a, nn.Module)]
    return models[0] if len(models) == 1 else None


def is_tensor_parallel_qwen35(model: Any) -> bool:
    """A model prepared by the plugin with a tp group."""
    from ..parallel.tensor_parallel import tensor_parallel_group

    return prepared_by_accelerate(model) and tensor_parallel_group(model) is not None


def prepared_qwen35(model: nn.Module) -> nn.Module | None:
    """The dense Qwen3.5 model inside what the plugin prepared (`model` itself, or inside a
    DDP-style `.module` or a PEFT wrapper), or None."""
    from ..model.detect import unwrap_qwen35

    for module in (model, getattr(model, "module", None)):
        if module is not None and prepared_by_accelerate(module):
            return unwrap_qwen35(module)
    return None
