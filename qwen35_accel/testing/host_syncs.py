"""Count the operations that make the host wait for the device, on any device (CPU included).

On CUDA `.item()` (`aten._local_scalar_dense`), `nonzero`, `masked_select`, `unique`, a
boolean-mask index (`aten.index` with a bool index) and `repeat_interleave` without
`output_size` copy a value or a size back to the host and stall the stream. On CPU nothing
stalls, but the same ops run: a `TorchDispatchMode` sees them, so "this layer makes no host
sync" and "adding layers adds none" are tests a CPU run can fail. The mode cannot run through
SDPA's `CausalBias` subclass: count around the code that needs it.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCING = {
    "aten::_local_scalar_dense": "item",
    "aten::nonzero": "nonzero",
    "aten::masked_select": "masked_select",
    "aten::_unique2": "unique",
    "aten::unique_dim": "unique",
    "aten::unique_consecutive": "unique",
}


def _bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostSyncCounter(TorchDispatchMode):
    """`with HostSyncCounter() as syncs: …` then `syncs.counts` (Counter by kind) and
    `syncs.total`. Counts forward and, when backward runs inside, backward ops too."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        name = func._schema.name
        kind = _SYNCING.get(name)
        if kind is None and name in ("aten::index", "aten::_unsafe_index") and _bool_index(args):
            kind = "bool_index"
        if kind is None and name == "aten::repeat_interleave" and (kwargs or {}).get("output_size") is None and len(args) < 3:
            kind = "repeat_interleave"
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))
