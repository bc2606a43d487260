"""How a tensor-parallel parameter is split (`_Sliced`), and which parameters of a model
are split: `plan` records each split module's layouts on it, the rest reads them back.

Every split is along dim 0 ("rows": segments of given sizes, each cut into tp equal
parts) or dim 1 ("cols": tp equal parts); rank r holds part r. Parameters keep their
Transformers names; the fp32 gate holder's path segment is dropped in state-dict keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...model.fp32_gate import transformers_name

TP_GROUP_ATTR = "_qwen35_tp_group"  # on split modules and TP norms: the tp process group
LAYOUTS_ATTR = "_qwen35_tp_layouts"  # on split modules: {parameter path inside: _Sliced}

Slicer = Callable[[torch.Tensor, int, int], torch.Tensor]  # (full, rank, tp) -> local


def _blocks(sizes: list[int]) -> Slicer:
    """Dim-0 segments of the given sizes, each cut into tp equal parts; rank r keeps part r
    of every segment, concatenated (e.g. the q, k, v segments of in_proj_qkv)."""

    def slicer(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        parts, start = [], 0
        for size in sizes:
            step = size // tp
            parts.append(full.narrow(0, start + rank * step, step))
            start += size
        return torch.cat(parts, dim=0)

    return slicer


def _columns(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    step = full.shape[1] // tp
    return full.narrow(1, rank * step, step)


def _unslice_blocks(sizes: list[int], parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `_blocks`: parts[r] is rank r's concatenation."""
    tp = len(parts)
    segments = []
    offsets = [0] * tp
    for size in sizes:
        step = size // tp
        for r in range(tp):
            segments.append(parts[r].narrow(0, offsets[r], step))
            offsets[r] += step
    return torch.cat(segments, dim=0)


class _Sliced:
    """How one parameter is split: `kind` "rows" (with dim-0 segment sizes) or "cols"."""

    def __init__(self, kind: str, sizes: list[int] | None = None) -> None:
        self.kind, self.sizes = kind, sizes

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        return _blocks(self.sizes)(full, rank, tp) if self.kind == "rows" else _columns(full, rank, tp)

    def gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return _unslice_blocks(self.sizes, parts) if self.kind == "rows" else torch.cat(parts, dim=1)

    def full_shape(self, local_shape: torch.Size | tuple[int, ...], tp: int) -> tuple[int, ...]:
        dim = 0 if self.kind == "rows" else 1
        return tuple(n * tp if i == dim else n for i, n in enumerate(local_shape))


def _rows(*sizes: int) -> _Sliced:
    return _Sliced("rows", list(sizes))


_COLS = _Sliced("cols")


def _split_entries(model: nn.Module) -> list[tuple[str, nn.Parameter, _Sliced, dist.ProcessGroup]]:
    """(state-dict key, parameter as the model holds it now, split, tp group) for every
    parameter tensor parallelism split. Look them up when needed: FSDP2 replaces the
    Parameter objects."""
    entries = []
    for prefix, module in model.named_modules():
        layouts = getattr(module, LAYOUTS_ATTR, None)
        for path, sliced in (layouts or {}).items():
            owner, _, name = path.rpartition(".")
            key = f"{prefix}.{transformers_name(path)}" if prefix else transformers_name(path)
            entries.append((key, module.get_submodule(owner)._parameters[name], sliced, getattr(module, TP_GROUP_ATTR)))
    return entries


def tensor_parallel_sliced(model: nn.Module) -> set[int]:
    """ids of the parameters tensor parallelism split (as the model holds them now)."""
    return {id(param) for _, param, _, _ in _split_entries(model)}


def tensor_parallel_numel_elsewhere(model: nn.Module) -> int:
    """Elements of the split parameters that the other tp ranks hold: this rank's count of
    `model`'s parameters plus this is the unsplit model's (0 when nothing is split)."""
    elsewhere = 0
    for _, param, sliced, group in _split_entries(model):
        full = math.prod(sliced.full_shape(param.shape, dist.get_world_size(group)))  # a DTensor's shape spans dp
        elsewhere += full - param.numel()
    return elsewhere


def tensor_parallel_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The tp group of `model`'s split modules, or None if nothing is split."""
    for module in model.modules():
        group = getattr(module, TP_GROUP_ATTR, None)
        if group is not None:
            return group
    return None
