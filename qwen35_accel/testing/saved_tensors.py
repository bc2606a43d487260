"""What autograd keeps for backward: bytes of the storages a computation's saved tensors hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def saved_storage_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run `fn` and return (its result, bytes of the distinct storages its saved tensors pin).

    A saved view counts its whole storage: that is what stays alive until backward. Only
    tensors saved while `fn` runs count (torch.autograd.graph.saved_tensors_hooks).
    """
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())
