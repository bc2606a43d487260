"""Context parallelism for custom training loops: shard a batch, gather a sequence.

Layout: the sequence is cut into 2·cp chunks; rank r of the cp group holds chunks r and
2·cp−1−r (balanced causal work). Positions travel with the tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from .parallel.context_parallel.collectives import all_gather_with_grad
from .parallel.context_parallel.layout import check_divisible, pad_for_context_parallel, shard_sequence, unshard_sequence

IGNORE_INDEX = -100

__all__ = ["shard_batch", "gather_sequence", "sharded_buffers"]


def _check_right_padding(attention_mask: torch.Tensor) -> None:
    mask = attention_mask.bool()
    # Right padding: once a row's mask drops to 0 it stays 0.
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError(
            "context parallelism supports right padding only; this attention_mask has a padded token before a real one "
            "(left padding or holes). Use padding_side='right' in the tokenizer/collator."
        )


def _check_not_packed(position_ids: torch.Tensor) -> None:
    # Only text positions [batch, seq] are checked: multimodal RoPE positions legitimately
    # stand still or jump across image tokens.
    if position_ids.dim() == 2 and (position_ids[:, 1:] - position_ids[:, :-1] != 1).any():
        raise ValueError(
            "position_ids restart or jump inside a row (packed sequences); context parallelism does not support packed "
            "sequences yet. Disable packing (e.g. padding-free collators) for CP runs."
        )


def shard_batch(batch: dict[str, Any], cp_mesh: DeviceMesh) -> dict[str, Any]:
    """This rank's part of a causal-LM batch for a cp group; `batch` is the same on every rank.

    Reads `input_ids` [batch, seq] (required), `labels`, `shift_labels`, `position_ids`
    ([batch, seq] or [3, batch, seq]), `attention_mask` [batch, seq] (right padding only).
    Returns the same keys sharded along the sequence, plus `position_ids` holding global
    positions (arange when absent) and `shift_labels` (labels shifted left, −100 at the
    end) when `labels` is given, since the next token of a chunk's last token lives on
    another rank. Lengths not divisible by 2·cp are right-padded (pad id 0, labels −100,
    mask 0). Other keys are passed through unchanged.
    Raises ValueError for left padding and packed sequences (position_ids restarting).
    """
    cp = cp_mesh.size()
    rank = cp_mesh.get_local_rank()
    input_ids = batch["input_ids"]
    seq = input_ids.shape[1]
    out = dict(batch)
    if batch.get("attention_mask") is not None:
        _check_right_padding(batch["attention_mask"])
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device).expand(input_ids.shape[0], seq)
    else:
        _check_not_packed(position_ids)
    if batch.get("labels") is not None and batch.get("shift_labels") is None:
        labels = batch["labels"]
        out["shift_labels"] = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)

    for key, fill in (("input_ids", 0), ("labels", IGNORE_INDEX), ("shift_labels", IGNORE_INDEX), ("attention_mask", 0)):
        if out.get(key) is not None:
            out[key] = shard_sequence(pad_for_context_parallel(out[key], cp, 1, fill), cp, rank, 1)
    seq_dim = position_ids.dim() - 1
    pad = (-seq) % (2 * cp)
    # Padded positions continue the sequence, so rotary stays finite and causal order holds.
    extra = position_ids[..., -1:] + torch.arange(1, pad + 1, device=position_ids.device)
    padded = torch.cat([position_ids, extra], dim=seq_dim)
    out["position_ids"] = shard_sequence(padded, cp, rank, seq_dim)
    return out


def gather_sequence(tensor: torch.Tensor, cp_mesh: DeviceMesh, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of the layout: every rank's local part -> the whole (padded) sequence.

    Autograd-aware: the gradient of each rank's local part is the sum over ranks of the
    gradients of its slice of the result (so compute a loss on the result on one rank,
    or divide by cp when every rank computes the same loss).
    """
    cp = cp_mesh.size()
    group = cp_mesh.get_group()
    gathered = all_gather_with_grad(tensor, group)
    return unshard_sequence(list(gathered.unbind(0)), cp, seq_dim)


@contextlib.contextmanager
def sharded_buffers(
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int] | None,
    no_restore: set[torch.Tensor] | None,
    cp_mesh: DeviceMesh,
) -> Iterator[None]:
    """Shard `buffers` in place along their `seq_dims` (default 1) with the CP layout.

    The in-place form of `shard_batch` that Accelerate's `maybe_context_parallel` needs
    (the Trainer passes `input_ids`, `labels`, `shift_labels`, `attention_mask`,
    `position_ids`, with `shift_labels` and global `position_ids` already added).
    Buffers not in `no_restore` get their whole sequence back on exit. Lengths must be
    divisible by 2·cp (ValueError naming `pad_to_multiple_of` otherwise): which value
    pads which buffer is not known here.
    """
    cp = cp_mesh.size()
    rank = cp_mesh.get_local_rank()
    dims = list(seq_dims) if seq_dims is not None else [1] * len(buffers)
    if len(dims) != len(buffers):
        raise ValueError(f"{len(buffers)} buffers but {len(dims)} sequence dims")
    for buffer, dim in zip(buffers, dims):
        check_divisible(buffer.shape[dim], cp)
    originals = []
    for buffer, dim in zip(buffers, dims):
        originals.append(buffer.data)
        buffer.data = shard_sequence(buffer.data, cp, rank, dim)
    try:
        yield
    finally:
        keep = no_restore or set()
        for buffer, original in zip(buffers, originals):
            if not any(buffer is k for k in keep):
                buffer.data = original
