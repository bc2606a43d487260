"""What autograd keeps for backward, and the peak bytes a computation adds."""

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


def saved_bytes_by_part(model: torch.nn.Module, fn: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """Run `fn` (a forward of a causal LM `model`, its text model at `model.model`) and return
    (its result, bytes of the distinct storages saved for backward): {"decoder": until the text
    model returns, "head": after it (lm_head, loss, TRL's fused head and what follows)}.
    Parameters are excluded as registered at each save: FSDP2 swaps in fresh unsharded ones."""
    from torch.distributed.tensor import DTensor

    def parameter_storages() -> set[int]:
        return {(p._local_tensor if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in model.parameters()}

    kept: dict[int, tuple[int, str]] = {}
    phase = ["decoder"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in kept and storage.data_ptr() not in parameter_storages():
            kept[storage.data_ptr()] = (storage.nbytes(), phase[0])
        return t

    hook = model.model.register_forward_hook(lambda *_: phase.__setitem__(0, "head"))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = fn()
    finally:
        hook.remove()
    return result, {part: sum(n for n, p in kept.values() if p == part) for part in ("decoder", "head")}


def peak_bytes_above(fn: Callable[[], Any], existing: Iterable[torch.Tensor] = ()) -> tuple[Any, int]:
    """Run `fn` and return (its result, the peak bytes of tensors alive during it above those
    alive when it started), on `existing`'s device (CPU if none): every tensor's storage from
    allocation to release (torch's MemTracker, a dispatch mode), not the process's RSS.
    `existing`: tensors made before `fn` that it uses (inputs, parameters)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    existing = list(existing)
    device = existing[0].device if existing else torch.device("cpu")
    tracker = MemTracker()
    tracker.track_external(*existing)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[device]["Total"]
        result = fn()
        return result, tracker.get_tracker_snapshot("peak")[device]["Total"] - before
