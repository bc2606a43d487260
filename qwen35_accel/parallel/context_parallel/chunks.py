"""Load-balanced sequence layout for context parallelism.

The sequence is cut into 2·cp equal chunks; rank r holds chunks r and 2·cp−1−r, in that
order, so every rank gets the same causal work. Local tokens keep their global positions.
"""

from __future__ import annotations

import torch


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two global chunk indices rank `rank` holds, in local order."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside a cp group of size {cp}")
    return rank, 2 * cp - 1 - rank


def chunk_owner(chunk: int, cp: int) -> tuple[int, int]:
    """(rank, local slot 0/1) holding global chunk `chunk`."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


def check_divisible(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp}; pad the batch (e.g. the data collator's "
            f"pad_to_multiple_of={2 * cp}) or use pad_for_context_parallel"
        )


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions [seq_len / cp] of rank `rank`'s tokens, in local order."""
    check_divisible(seq_len, cp)
    chunk = seq_len // (2 * cp)
    a, b = rank_chunks(rank, cp)
    return torch.cat([torch.arange(a * chunk, (a + 1) * chunk, device=device), torch.arange(b * chunk, (b + 1) * chunk, device=device)])


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of `tensor` along `seq_dim` (length divisible by 2·cp)."""
    return tensor.index_select(seq_dim, local_positions(tensor.shape[seq_dim], cp, rank, tensor.device))


def unshard_sequence(parts: list[torch.Tensor], cp: int, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: `parts[r]` is rank r's part; returns the whole sequence."""
    half = parts[0].shape[seq_dim] // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.split(half, dim=seq_dim)
        a, b = rank_chunks(rank, cp)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=seq_dim)  # type: ignore[arg-type]


def pad_for_context_parallel(tensor: torch.Tensor, cp: int, seq_dim: int = 1, value: float | int = 0) -> torch.Tensor:
    """Right-pad `tensor` along `seq_dim` to a multiple of 2·cp with `value`
    (use -100 for labels so padded tokens are ignored by the loss)."""
    pad = (-tensor.shape[seq_dim]) % (2 * cp)
    if pad == 0:
        return tensor
    shape = list(tensor.shape)
    shape[seq_dim] = pad
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=seq_dim)
