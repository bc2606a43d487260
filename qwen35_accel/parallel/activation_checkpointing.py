"""Activation checkpointing per decoder layer and vision block (non-reentrant), composable with FSDP2."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed._composable import checkpoint

from ..model.detect import Qwen35Parts
from .activation_offload import ActivationOffload


def vision_tower_trains(parts: Qwen35Parts) -> bool:
    """Whether a VLM's vision tower has a parameter that requires grad (False for a text model)."""
    return parts.vision_model is not None and any(p.requires_grad for p in parts.vision_model.parameters())


def checkpoint_targets(parts: Qwen35Parts) -> tuple[nn.Module, ...]:
    """The modules `activation_checkpointing=True` checkpoints: every decoder layer and, when
    the vision tower trains (`vision_tower_trains`), every vision block.

    A frozen tower is left alone: its forward records no autograd graph (frozen parameters,
    pixel values without grad), so its blocks keep nothing for backward and there is
    nothing to recompute; checkpointing them would only add hooks to every call.
    """
    return parts.decoder_layers + (parts.vision_blocks if vision_tower_trains(parts) else ())


def describe_checkpoint_targets(parts: Qwen35Parts) -> str:
    """What `checkpoint_targets(parts)` covers, for log lines: "each decoder layer", "… and
    vision block", or a note that a frozen tower is not checkpointed."""
    if parts.vision_model is None:
        return "each decoder layer"
    if vision_tower_trains(parts):
        return "each decoder layer and vision block"
    return "each decoder layer, not the frozen vision tower, which keeps no activations"


class CheckpointingChoice(NamedTuple):
    """`choose_activation_checkpointing`'s answer: the prepared line's text, whether ours checkpoints
    (`checkpoint_targets`), whether ours keeps their saved inputs in host memory."""

    line: str
    ours: bool
    offload: bool


def choose_activation_checkpointing(
    parts: Qwen35Parts, ours: bool, offload: bool = False, offload_asked_by: str = "activation_offload=True"
) -> CheckpointingChoice:
    """Which checkpointing the decoder layers and vision blocks get (`PARALLELIZER.apply`'s
    activation-checkpointing step: `ours` is its `activation_checkpointing` option, `offload` its
    `activation_offload`, which the line credits to `offload_asked_by`: the option, or the
    Accelerate config's `fsdp_activation_checkpointing_offload` under the plugin); never two at once
    on one module.

    Transformers' gradient checkpointing (`gradient_checkpointing_enable()`, the Trainer's
    `gradient_checkpointing` / `activation_checkpointing`, TRL's default) sets a
    `gradient_checkpointing` flag on each `GradientCheckpointingLayer` (decoder layers and
    vision blocks), which then checkpoints its own call while training. With the FSDP
    plugin's `activation_checkpointing` the parallelizer checkpoints each decoder layer and,
    when the tower trains, each vision block as well (`checkpoint_targets`); both at once (a
    custom loop; the Trainer refuses both itself) would checkpoint a module twice, which a
    reentrant inner checkpoint pays with a third forward. Ours wins, as the Trainer's own
    rule has it ("use FSDP's activation checkpointing when using FSDP"): it is the one the
    Accelerate config asked for, so the flags of the modules it checkpoints are turned off
    (a frozen tower's flagged blocks, which ours leaves alone, keep Transformers').

    Offload (the saved inputs in host memory) is never dropped: ours offloads when asked (`offload`:
    the option, Accelerate's `fsdp_activation_checkpointing_offload` under the plugin), or when Transformers'
    checkpointing it replaces was enabled with `offload=True` (`gradient_checkpointing_kwargs`).
    Transformers' checkpointing with offload on every decoder layer is taken over by ours with
    offload (the same layers; copies without a host sync, where Transformers' `save_on_cpu` syncs
    on every copy and cannot run on a CPU-only torch: "pin_memory=True requires a CUDA …"); on
    only some layers (`every_n_layers`) it stays Transformers', offload included. Returns the
    prepared line's text, whether ours checkpoints and whether ours offloads.
    """
    layers = parts.decoder_layers
    flagged = [layer for layer in layers if getattr(layer, "gradient_checkpointing", False) is True]
    blocks = [block for block in parts.vision_blocks if getattr(block, "gradient_checkpointing", False) is True]
    transformers_offload = any(_offloads(m) for m in (*flagged, *blocks))
    taken_over = not ours and transformers_offload and len(flagged) == len(layers) > 0
    if ours or taken_over:
        targets = checkpoint_targets(parts)
        turned_off = [m for m in (*flagged, *blocks) if any(m is t for t in targets)]
        others = [block for block in blocks if not any(block is t for t in targets)]
        carried = any(_offloads(m) for m in turned_off)  # Transformers' offload on what ours now checkpoints
        offloads = offload or carried
        for module in turned_off:
            module.gradient_checkpointing = False
        also = f"; Transformers' gradient checkpointing on {len(others)} vision blocks" if others else ""
        what = describe_checkpoint_targets(parts)
        if offloads:
            asked = [name for name, on in ((offload_asked_by, offload), ("Transformers' offload", carried)) if on]
            what += f"; their saved inputs in host memory ({' and '.join(asked)})"
        if taken_over:
            return CheckpointingChoice(f"qwen35_accel's ({what}; in place of Transformers' gradient checkpointing with offload{also})", True, offloads)
        if turned_off:
            return CheckpointingChoice(
                f"qwen35_accel's ({what}; Transformers' gradient checkpointing was on too and is turned off "
                f"on them, so nothing is checkpointed twice{also})", True, offloads
            )
        return CheckpointingChoice(f"qwen35_accel's ({what}{also})", True, offloads)
    also = f"; Transformers' gradient checkpointing on {len(blocks)} vision blocks" if blocks else ""
    held = "; saved inputs in host memory (Transformers' offload)" if transformers_offload else ""
    if flagged:
        named = f", {len(blocks)} vision blocks" if blocks else ""
        text = f"Transformers' gradient checkpointing ({len(flagged)} of {len(layers)} decoder layers{named}{held})"
        return CheckpointingChoice(text, False, False)
    return CheckpointingChoice(f"none{also}{held if blocks else ''}", False, False)


def _offloads(module: nn.Module) -> bool:
    """Whether Transformers' checkpointing of `module` keeps its saved inputs in host memory: its
    checkpoint function (`_gradient_checkpointing_func`, a partial) runs under `save_on_cpu`, what
    `activation_checkpointing_enable(offload=True)` (the Trainer's `gradient_checkpointing_kwargs=
    {"offload": True}`) sets."""
    function = getattr(module, "_gradient_checkpointing_func", None)
    while isinstance(function, functools.partial):
        function = function.func
    code = getattr(function, "__code__", None)
    return code is not None and "save_on_cpu" in code.co_names


def apply_activation_checkpointing(layers: Iterable[nn.Module], offload: ActivationOffload | None = None) -> int:
    """Recompute each layer's (or vision block's) activations in backward instead of storing them.

    Uses torch's composable `checkpoint` (non-reentrant, hooks on the module itself):
    parameter names and state-dict keys stay exactly the Transformers ones, unlike
    `checkpoint_wrapper`, which inserts `_checkpoint_wrapped_module` into every name.
    Apply before FSDP2 (`fully_shard` then sees the same modules). A training forward of
    a checkpointed layer gets no cache. With `offload`, the inputs each layer keeps for its
    recompute live in host memory between forward and backward (`ActivationOffload`).
    Returns the count.
    """
    count = 0
    for layer in layers:
        # Before checkpoint's own pre-hook, which keeps the kwargs for the recomputation.
        layer.register_forward_pre_hook(_no_cache_while_training, with_kwargs=True)
        checkpoint(layer)
        if offload is not None:
            offload.attach(layer)
        count += 1
    return count


def _no_cache_while_training(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A training forward of a checkpointed layer runs without a cache, as Transformers'
    own gradient checkpointing does: the recomputation in backward would otherwise see
    the cache the first forward already updated (Qwen3.5's config has `use_cache=True`,
    so a Trainer's forward carries one) and fail torch's metadata check."""
    if module.training and torch.is_grad_enabled():
        for key in ("cache", "past_key_values", "cache_params"):
            if key in kwargs:
                kwargs[key] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
    return args, kwargs
