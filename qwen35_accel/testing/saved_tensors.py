"""What autograd keeps for backward: bytes of the storages a computation's saved tensors hold."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def saved_storage_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> tuple[Any, int]:
    """Run `fn` and return (its result, bytes of the distinct storages its saved tensors pin).

    A saved view counts its whole storage: that is what stays alive until backward. Only
    tensors saved while `fn` runs count (torch.autograd.graph.saved_tensors_hooks), and
    none whose storage is one of `exclude`'s (e.g. the parameters: alive anyway).
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())
