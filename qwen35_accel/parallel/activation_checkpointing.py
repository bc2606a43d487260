"""Activation checkpointing per decoder layer and vision block (non-reentrant), composable with FSDP2."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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
