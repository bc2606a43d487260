"""Generation with the FSDP2 units gathered once per `generate` call, not once per token.

A cached generation runs one forward per new token, and FSDP2 all-gathers every unit in each
forward (and reshards it after, `reshard_after_forward`): a model's worth of all-gathers per
token. `units_gathered(model)` unshards every unit once, keeps them unsharded through the
block (no reshard after forward) and reshards them after, when the unsharded parameters fit
(`gathering_fits`): on CUDA, what the unsharding adds against the device's free memory; on
CPU, against the host's available memory. Every rank takes the same decision (a MIN over the
default group): a rank that gathered per forward while another did not would issue
collectives the other never matches. Numerically nothing changes: the same gathered
parameters, in the policy's `param_dtype`, compute every forward.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger(__name__)

# Of the free memory, what the gathered parameters may take (the rest: the cache, the logits, the
# allocator's fragmentation).
FREE_MEMORY_SHARE = 0.8
_said: set[str] = set()


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def unsharding_bytes(model: nn.Module) -> int:
    """Bytes the unsharding of `model`'s FSDP2 units adds on this rank: each parameter's
    unsharded size in its unit's `param_dtype` (FSDP2's all-gather dtype); the shards stay
    allocated beside them."""
    total = 0
    for unit in _units(model):
        state = unit._get_fsdp_state()
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                dtype = fsdp_param.param_dtype or fsdp_param.orig_dtype
                total += fsdp_param._orig_size.numel() * dtype.itemsize
    return total


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def gathering_fits(model: nn.Module, device: torch.device) -> tuple[bool, int, int]:
    """(whether every rank can hold `model`'s units unsharded, the bytes that adds here, the free
    bytes here). Collective over the default group when it is initialised."""
    needed, free = unsharding_bytes(model), _free_bytes(device)
    fits = torch.tensor([int(needed <= FREE_MEMORY_SHARE * free)], device=device if device.type == "cuda" else "cpu")
    if dist.is_initialized():
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    return bool(fits.item()), needed, free


def _supported(units: list[FSDPModule]) -> bool:
    """Whether this torch's FSDP2 has the names `units_gathered` uses (read from torch 2.11–2.15)."""
    return all(hasattr(u, "_get_fsdp_state") for u in units) and all(
        all(hasattr(u._get_fsdp_state(), name) for name in ("_fsdp_param_groups", "_auto_reshard_after_forward", "_lazy_init"))
        for u in units
    )


@contextlib.contextmanager
def units_gathered(model: nn.Module, device: torch.device) -> Iterator[bool]:
    """For the block, `model`'s FSDP2 units unsharded once and kept so (see module doc), where
    they fit; else FSDP2's per-forward gathering. Yields which. Logs the choice once per process."""
    units = _units(model)
    if not units or not _supported(units):
        yield False
        return
    # The root's lazy initialisation (what its first forward does) first: it sets each parameter's
    # dtypes, makes the outermost unit the root and clears the root's reshard-after-forward.
    units[0]._get_fsdp_state()._lazy_init()
    fits, needed, free = gathering_fits(model, device)
    choice = "once per generate call" if fits else "per forward (FSDP2's default)"
    if choice not in _said and (not dist.is_initialized() or dist.get_rank() == 0):
        _said.add(choice)
        logger.warning("qwen35_accel: generation gathers the parameters %s: unsharded they take %.2f GiB more on rank 0, "
                       "%.2f GiB free there (every rank agreed)", choice, needed / 2**30, free / 2**30)
    if not fits:
        yield False
        return
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()
        saved.append((state, state._auto_reshard_after_forward,
                       [(group, group.post_forward_mesh_info) for group in state._fsdp_param_groups]))
        state._auto_reshard_after_forward = False
        for group in state._fsdp_param_groups:
            group.post_forward_mesh_info = None  # no reshard after forward
    try:
        for unit in units:
            unit.unshard()
        yield True
    finally:
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, info in groups:
                group.post_forward_mesh_info = info
        for unit in units:
            unit.reshard()
