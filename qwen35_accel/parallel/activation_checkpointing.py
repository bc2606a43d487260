"""Activation checkpointing per decoder layer (non-reentrant), composable with FSDP2."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed._composable import checkpoint


def apply_activation_checkpointing(layers: Iterable[nn.Module]) -> int:
    """Recompute each layer's activations in backward instead of storing them.

    Uses torch's composable `checkpoint` (non-reentrant, hooks on the module itself):
    parameter names and state-dict keys stay exactly the Transformers ones, unlike
    `checkpoint_wrapper`, which inserts `_checkpoint_wrapped_module` into every name.
    Apply before FSDP2 (`fully_shard` then sees the same modules). Returns the count.
    """
    count = 0
    for layer in layers:
        checkpoint(layer)
        count += 1
    return count
