"""Activation checkpointing per decoder layer (non-reentrant), composable with FSDP2."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint


def apply_activation_checkpointing(layers: Iterable[nn.Module]) -> int:
    """Recompute each layer's activations in backward instead of storing them.

    Uses torch's composable `checkpoint` (non-reentrant, hooks on the module itself):
    parameter names and state-dict keys stay exactly the Transformers ones, unlike
    `checkpoint_wrapper`, which inserts `_checkpoint_wrapped_module` into every name.
    Apply before FSDP2 (`fully_shard` then sees the same modules). A training forward of
    a checkpointed layer gets no cache. Returns the count.
    """
    count = 0
    for layer in layers:
        # Before checkpoint's own pre-hook, which keeps the kwargs for the recomputation.
        layer.register_forward_pre_hook(_no_cache_while_training, with_kwargs=True)
        checkpoint(layer)
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
