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

from .model.packing import DocumentLayout, document_layout, layout_from_starts
from .parallel.collectives import all_gather_with_grad
from .parallel.context_parallel.chunks import check_divisible, pad_for_context_parallel, shard_sequence, unshard_sequence
from .parallel.context_parallel.model import context_parallel_paused

IGNORE_INDEX = -100

__all__ = [
    "shard_batch", "gather_sequence", "sharded_buffers", "pad_batch_for_context_parallel", "context_parallel_paused",
]


def _check_right_padding(attention_mask: torch.Tensor) -> None:
    mask = attention_mask.bool()
    # Right padding: once a row's mask drops to 0 it stays 0.
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError(
            "context parallelism supports right padding only; this attention_mask has a padded token before a real one "
            "(left padding or holes). Use padding_side='right' in the tokenizer/collator."
        )


_PAD_VALUES = {"input_ids": 0, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0}
# Padded like the sequence but never sharded: the model under CP reads the whole rows.
_WHOLE_ROW_PAD_VALUES = {"mm_token_type_ids": 0}


def pad_batch_for_context_parallel(batch: dict[str, Any], cp: int) -> dict[str, Any]:
    """`batch` right-padded along the sequence to a multiple of 2·cp (a new dict; the
    same one when nothing is missing).

    Pads `input_ids` (0), `inputs_embeds` (0), `labels`/`shift_labels` (−100),
    `attention_mask` (0; a batch without one gets one, 1 on its own tokens, so that counts
    of real tokens stay exact: TRL counts a mask-less row's positions), `mm_token_type_ids`
    (0, text); `position_ids` ([batch, seq] or [k, batch, seq]) continue each row's last
    position, so padded tokens extend the last document of a packed row and nothing before
    them changes (causality). The packed-row forms follow: `cu_seq_lens_q`/`cu_seq_lens_k`
    (offsets in the flattened batch) are rebuilt for the padded rows, `max_length_q`/
    `max_length_k` updated, `seq_idx` continues each row's last index.
    """
    tokens = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
    rows, seq = tokens.shape[:2]
    pad = (-seq) % (2 * cp)
    if pad == 0:
        return batch
    out = dict(batch)
    if out.get("attention_mask") is None:
        out["attention_mask"] = torch.ones(rows, seq, dtype=torch.long, device=tokens.device)
    for key, fill in (*_PAD_VALUES.items(), *_WHOLE_ROW_PAD_VALUES.items(), ("inputs_embeds", 0)):
        if out.get(key) is not None:
            out[key] = pad_for_context_parallel(out[key], cp, 1, fill)
    position_ids = out.get("position_ids")
    if position_ids is not None:
        extra = position_ids[..., -1:] + torch.arange(1, pad + 1, device=position_ids.device)
        out["position_ids"] = torch.cat([position_ids, extra], dim=-1)
    if out.get("seq_idx") is not None:
        seq_idx = out["seq_idx"].view(rows, seq)
        out["seq_idx"] = torch.cat([seq_idx, seq_idx[:, -1:].expand(rows, pad)], dim=1)
    longest = None
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        cu = out.get(key)
        if cu is None:
            continue
        flat = cu.flatten().long()
        if int(flat[-1]) != rows * seq:
            raise ValueError(f"{key} must end at the number of tokens in the batch ({rows} x {seq} = {rows * seq}); got {int(flat[-1])}")
        starts = torch.zeros(rows, seq + pad, dtype=torch.bool, device=cu.device)
        starts[:, :seq] = DocumentLayout(flat, 0).starts(rows, seq)  # the padding extends each row's last document
        padded = layout_from_starts(starts)
        out[key], longest = padded.cu_seq_lens.to(cu.dtype), padded.max_length
    for key in ("max_length_q", "max_length_k"):
        if out.get(key) is not None and longest is not None:
            out[key] = longest
    return out


def shard_batch(batch: dict[str, Any], cp_mesh: DeviceMesh) -> dict[str, Any]:
    """This rank's part of a causal-LM batch for a cp group; `batch` is the same on every rank.

    Reads `input_ids` [batch, seq] (required), `labels`, `shift_labels`, `position_ids`
    ([batch, seq] or [3, batch, seq]), `attention_mask` [batch, seq] (right padding only).
    Returns the same keys sharded along the sequence, plus `position_ids` holding global
    positions (arange when absent) and `shift_labels` (labels shifted left, −100 at the
    end) when `labels` is given, since the next token of a chunk's last token lives on
    another rank. Lengths not divisible by 2·cp are right-padded
    (`pad_batch_for_context_parallel`). Other keys are passed through unchanged.

    Packed rows (several documents per row: `position_ids` restarting, `cu_seq_lens_q`/
    `cu_seq_lens_k`, `seq_idx`) are accepted: the forms are checked to agree,
    `position_ids` restarting per document are added when only the others were given,
    and `cu_seq_lens_*`/`seq_idx` stay whole-row (padded, not sharded), as the model
    under CP reads them. Raises ValueError for left padding and forms that disagree.

    VLM batches (`Qwen3_5ForConditionalGeneration`): `pixel_values`, `image_grid_thw`,
    `pixel_values_videos`, `video_grid_thw` pass through whole, and `mm_token_type_ids`
    [batch, seq] whole too (right-padded with 0 like the sequence, not sharded). The model
    under CP then expects exactly that: sharded `input_ids`/`labels`/`shift_labels`/
    `attention_mask`, 2-D global `position_ids` (or 3-row mRoPE ids, sharded, used as
    given), the vision inputs and `mm_token_type_ids` whole and the same on every cp rank.
    Each cp rank encodes a share of the images and videos, the embeddings are all-gathered,
    and the mRoPE positions are computed on the whole rows
    (`parallel/context_parallel/vision_split.py`). Packed rows with images are refused.
    """
    cp = cp_mesh.size()
    rank = cp_mesh.get_local_rank()
    input_ids = batch["input_ids"]
    rows, seq = input_ids.shape
    out = dict(batch)
    if batch.get("attention_mask") is not None:
        _check_right_padding(batch["attention_mask"])
    layout = document_layout(
        rows,
        seq,
        position_ids=batch.get("position_ids"),
        cu_seq_lens_q=batch.get("cu_seq_lens_q"),
        cu_seq_lens_k=batch.get("cu_seq_lens_k"),
        seq_idx=batch.get("seq_idx"),
    )
    if out.get("position_ids") is None:
        if layout is not None:
            out["position_ids"] = layout.position_ids(rows, seq)
        else:
            out["position_ids"] = torch.arange(seq, device=input_ids.device).expand(rows, seq)
    if batch.get("labels") is not None and batch.get("shift_labels") is None:
        labels = batch["labels"]
        out["shift_labels"] = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
    out = pad_batch_for_context_parallel(out, cp)
    for key in (*_PAD_VALUES, "inputs_embeds"):
        if out.get(key) is not None:
            out[key] = shard_sequence(out[key], cp, rank, 1)
    position_ids = out["position_ids"]
    out["position_ids"] = shard_sequence(position_ids, cp, rank, position_ids.dim() - 1)
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
