"""Generation with the FSDP2 units gathered once per `generate` call, not once per token.

A cached generation runs one forward per new token, and FSDP2 all-gathers every unit in each
forward (and reshards it after, `reshard_after_forward`): a model's worth of all-gathers per
token. `units_gathered(model)` unshards every unit once, keeps them unsharded through the
block (no reshard after forward) and reshards them after, when the unsharded parameters and
the generation's cache fit (`gathering_fits`): on CUDA, against the device's free memory
counting what the caching allocator holds unused as free; on CPU, against the host's
available memory. Every rank takes the same decision (a MIN over the default group): a rank
that gathered per forward while another did not would issue collectives the other never
matches. Numerically nothing changes: the same gathered parameters, in the policy's
`param_dtype`, compute every forward.

Only FSDP2's public API is used (`FSDPModule.set_reshard_after_forward`, `unshard`, `reshard`),
with what qwen35_accel recorded when it made each unit (`parallel/fsdp.UnitRecord`: the
parameters, the policy's `param_dtype`, the `reshard_after_forward` to restore).
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

from .fsdp import UnitRecord, unit_record

logger = logging.getLogger(__name__)

# Of the free memory, what the gathered parameters and the cache may take (the rest: the logits,
# the allocator's fragmentation).
FREE_MEMORY_SHARE = 0.8
_said: set[str] = set()


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _records(units: list[FSDPModule]) -> list[UnitRecord] | None:
    """Each unit's record (a unit of several modules once), or None where a unit was not made by
    qwen35_accel (its policy and settings are then unknown here)."""
    records: dict[int, UnitRecord] = {}
    for unit in units:
        record = unit_record(unit)
        if record is None:
            return None
        records.setdefault(id(record), record)
    return list(records.values())


def unsharding_bytes(model: nn.Module) -> int:
    """Bytes the unsharding of `model`'s FSDP2 units adds on this rank: each parameter's
    unsharded size in its unit's `param_dtype` (FSDP2's all-gather dtype); the shards stay
    allocated beside them. 0 where a unit was not made by qwen35_accel."""
    total = 0
    for record in _records(_units(model)) or []:
        for param in record.parameters():  # a DTensor's numel is the unsharded one
            total += param.numel() * (record.mp_policy.param_dtype or param.dtype).itemsize
    return total


def free_bytes(device: torch.device) -> int:
    """What this rank can still allocate on `device`: on CUDA the driver's free memory plus what
    torch's caching allocator reserved and does not use (after a training step most of a step's
    peak stays reserved; `mem_get_info` counts it as used); on the host, the available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def gathering_fits(model: nn.Module, device: torch.device, cache_bytes: int = 0) -> tuple[bool, int, int]:
    """(whether every rank can hold `model`'s units unsharded beside a generation cache of
    `cache_bytes`, the bytes that adds here, the free bytes here). Collective over the default
    group when it is initialised."""
    needed, free = unsharding_bytes(model) + cache_bytes, free_bytes(device)
    fits = torch.tensor([int(needed <= FREE_MEMORY_SHARE * free)], device=device if device.type == "cuda" else "cpu")
    if dist.is_initialized():
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    return bool(fits.item()), needed, free


def generation_cache_bytes(config: object, rows: int, tokens: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes of Transformers' Qwen3.5 cache on this rank for `rows` sequences of up to `tokens`
    tokens (prompt and completion): the full-attention layers' keys and values in `dtype`, the
    GatedDeltaNet layers' conv windows in `dtype` and recurrent states in fp32 (an upper bound:
    they follow the compute dtype), each split over `tp` ranks by heads. `config`: the model's
    config (a VLM's text config is read)."""
    text = config.get_text_config()  # type: ignore[attr-defined]
    full = sum(kind == "full_attention" for kind in text.layer_types)
    linear = len(text.layer_types) - full
    keys_values = 2 * text.num_key_value_heads * text.head_dim * tokens * dtype.itemsize
    conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim + text.linear_num_value_heads * text.linear_value_head_dim
    conv = conv_dim * text.linear_conv_kernel_dim * dtype.itemsize
    recurrent = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
    return rows * (full * keys_values + linear * (conv + recurrent)) // tp


def _resting(record: UnitRecord, root: bool) -> bool | None:
    """The `reshard_after_forward` a unit returns to after the block: the root stays gathered
    after forward (what FSDP2's root initialisation makes it), another unit its recorded value
    (None: FSDP2's default, True); None where that is an int (HSDP's partial reshard), which the
    public setter does not take."""
    if root:
        return False
    value = True if record.reshard_after_forward is None else record.reshard_after_forward
    return value if isinstance(value, bool) else None


@contextlib.contextmanager
def units_gathered(model: nn.Module, device: torch.device, cache_bytes: int = 0) -> Iterator[bool]:
    """For the block, `model`'s FSDP2 units unsharded once and kept so (see module doc), where
    they and a cache of `cache_bytes` fit; else FSDP2's per-forward gathering. Yields which.
    Logs the choice once per process."""
    units = _units(model)
    records = [unit_record(unit) for unit in units]
    resting = [None if r is None else _resting(r, root=i == 0) for i, r in enumerate(records)]
    if not units or None in resting:  # a unit not made here, or an int reshard_after_forward
        yield False
        return
    fits, needed, free = gathering_fits(model, device, cache_bytes)
    choice = "once per generate call" if fits else "per forward (FSDP2's default)"
    if choice not in _said and (not dist.is_initialized() or dist.get_rank() == 0):
        _said.add(choice)
        logger.warning("qwen35_accel: generation gathers the parameters %s: unsharded, with the cache, they take %.2f GiB "
                       "more on rank 0, %.2f GiB free there (every rank agreed)", choice, needed / 2**30, free / 2**30)
    if not fits:
        yield False
        return
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in units:
            unit.unshard()
        yield True
    finally:
        for unit, value in zip(units, resting):
            unit.set_reshard_after_forward(value, recurse=False)
        for unit in units:
            unit.reshard()
