"""Packed rows under context parallelism: where each local token's document starts.

A packed row's documents may straddle chunk and rank boundaries, so a rank cannot tell
from its own tokens whether its first token continues a document. The CP pre-hook
(`model.py`) all-gathers the local text positions once per forward (one [batch, local
seq] long tensor per rank), finds the boundaries of the whole row with the same rule as
without CP (`model.packing.document_layout`, which also checks `cu_seq_lens_*`/`seq_idx`
against them) and hands every layer a `ShardedDocuments` as the `DOCUMENTS_KWARG` kwarg:

- the causal conv masks its window before the token's document start,
- the gated delta rule resets its state at every start (a chunk holding one has M = 0),
- attention lets each query see the keys from its document's start to itself.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...ops.causal_conv import seq_idx_to_cu_seqlens
from ...ops.documents import document_groups
from .chunks import local_positions

DOCUMENTS_KWARG = "qwen35_sharded_documents"


@dataclasses.dataclass(frozen=True)
class ShardedDocuments:
    """One rank's tokens of packed rows, in layout order.

    `index` [local_seq] long: each local token's index in the whole row; `doc_start`
    [batch, local_seq] long: the index in the whole row of its document's first token.
    """

    index: torch.Tensor
    doc_start: torch.Tensor

    # Made once per forward and read by every layer, so the derived tensors are cached.
    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        """[batch, local_seq] long: tokens since the document's start (0 at a start)."""
        return self.index[None, :] - self.doc_start

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        """[batch, local_seq] bool: the token starts a document."""
        return self.offsets == 0

    def conv_seq_idx(self, halo: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per local chunk, causal-conv1d's `seq_idx` for its conv input `[halo | chunk]`
        (`conv_seq_idx` below), made once per forward for all GatedDeltaNet layers."""
        cache = self.__dict__.setdefault("_conv_seq_idx", {})  # a frozen dataclass: no attribute assignment
        if halo not in cache:
            first, second = self.offsets.chunk(2, dim=1)
            cache[halo] = (conv_seq_idx(first, halo), conv_seq_idx(second, halo))
        return cache[halo]

    def conv_cu_seqlens(self, halo: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same windows as `conv_seq_idx(halo)`, as FLA's conv takes them: per local chunk,
        `cu_seqlens` [segments + 1] int32 over its flattened [batch · (halo + n)] conv input.
        Made once per forward (one host sync per chunk), not once per layer."""
        cache = self.__dict__.setdefault("_conv_cu_seqlens", {})
        if halo not in cache:
            first, second = self.conv_seq_idx(halo)
            cache[halo] = (seq_idx_to_cu_seqlens(first), seq_idx_to_cu_seqlens(second))
        return cache[halo]

    @functools.cached_property
    def first_keys(self) -> tuple[int, int]:
        """Per local chunk, the earliest document start among its queries (the first key
        attention needs): one host sync per forward, shared by every attention layer."""
        half = self.doc_start.shape[1] // 2
        firsts = torch.stack([self.doc_start[:, :half].min(), self.doc_start[:, half:].min()]).tolist()
        return firsts[0], firsts[1]

    @functools.cached_property
    def pieces(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The local tokens cut at document starts and at the two chunks' starts, once per
        forward (every GatedDeltaNet layer reuses it, and so `ops.documents`' grouping,
        cached per offsets tensor): (piece index [batch, local_seq] long, offsets
        [pieces + 1] long in the flattened [batch * local_seq] tokens)."""
        cuts = self.starts.clone()
        cuts[:, 0] = cuts[:, cuts.shape[1] // 2] = True
        flat = cuts.reshape(-1)
        offsets = torch.nonzero(flat).flatten()
        cu = torch.cat([offsets, offsets.new_tensor([flat.numel()])])
        return flat.long().cumsum(0).view(cuts.shape) - 1, cu


    def precompute(self, conv_halo: int, conv_segments: bool, sdpa: bool) -> None:
        """Make what the layers read, in the CP pre-hook (before the first layer), so that no
        layer's forward or backward waits on the host: the pieces and their groups (the gated
        delta rule), what attention reads (`sdpa`: the pieces' table, else each chunk's first
        key), and the causal conv's windows (`conv_segments`: as FLA's `cu_seqlens`, else as
        `seq_idx`) for a kernel of `conv_halo + 1` taps."""
        document_groups(self.pieces[1])
        self.attention_pieces if sdpa else self.first_keys  # noqa: B018 (cached properties: computed here)
        (self.conv_cu_seqlens if conv_segments else self.conv_seq_idx)(conv_halo)

    @functools.cached_property
    def attention_pieces(self) -> tuple[tuple[int, int, int, int, int], ...]:
        """The `pieces` as attention needs them, on the host: per piece (row, first local
        token, end local token, first key, end key), keys as indices in the whole row. A
        piece's queries attend to keys [first key, end key) causally, aligned to the end:
        its document's start up to its last query. One host sync per forward, shared by
        every attention layer."""
        _, cu = self.pieces
        seq = self.doc_start.shape[1]
        first = cu[:-1]
        end = first % seq + (cu[1:] - first)  # a piece never crosses a row (each row's token 0 starts one)
        table = torch.stack([first // seq, first % seq, end, self.doc_start.reshape(-1)[first], self.index[end - 1] + 1], dim=1)
        return tuple(tuple(row) for row in table.tolist())


def conv_seq_idx(offsets: torch.Tensor, halo: int) -> torch.Tensor:
    """causal-conv1d's `seq_idx` [batch, halo + n] int32 for a chunk's conv input `[halo | chunk]`.

    `offsets` [batch, n]: each chunk token's distance from its document's start. Chunk
    tokens are numbered 1 + (document starts so far in the chunk); a halo token d places
    before the chunk shares the first token's document (index 1) when d ≤ offsets[:, 0],
    else gets 0. So every window stops at its token's document start: exactly each
    document convolved alone with zeros before it.
    """
    chunk = 1 + (offsets == 0).long().cumsum(dim=1)
    distance = torch.arange(halo, 0, -1, device=offsets.device)  # halo, ..., 1
    before = (distance[None, :] <= offsets[:, :1]).long()
    return torch.cat([before, chunk], dim=1).to(torch.int32).contiguous()


def shard_documents(starts: torch.Tensor, cp: int, rank: int) -> ShardedDocuments:
    """`starts` [batch, seq] bool (document starts in the whole rows, each row's first
    token one) -> rank `rank`'s `ShardedDocuments` in a cp group of `cp`."""
    seq = starts.shape[1]
    index = torch.arange(seq, device=starts.device)
    doc_start = torch.where(starts, index, 0).cummax(dim=1).values
    local = local_positions(seq, cp, rank, starts.device)
    return ShardedDocuments(local, doc_start[:, local])
