"""GatedDeltaNet under context parallelism: state passing and a conv halo, nothing more.

Each rank holds two chunks of the sequence (see `chunks`). The recurrence crosses chunk
boundaries through the state alone: every chunk is summarised as an affine map of its
incoming state (`ops.gated_delta.chunk_summary`), the summaries are all-gathered (their
size depends on heads and head dims, not on the sequence), every rank folds them in
sequence order, and each chunk reads its incoming state. The depthwise causal conv needs
the last K−1 pre-conv inputs before each chunk: a halo, also independent of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ...model.fp32_gate import (
    COMPILED_STEPS_ATTR,
    Fp32GateGatedDeltaNet,
    Fp32GateMoeGatedDeltaNet,
    Fp32GateQwen3NextGatedDeltaNet,
)
from ...ops.causal_conv import ConvKernel, fla_conv_kernel, select_conv_kernel, torch_conv_kernel
from ...ops.documents import per_document_with_state
from ...ops.gated_delta import Kernel, chunk_summary, read_state, select_kernel
from ..collectives import all_gather_with_grad
from .sharded_documents import DOCUMENTS_KWARG, ShardedDocuments
from .chunks import chunk_owner, rank_chunks
from .state_exchange import incoming_states


def cp_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    use_qk_l2norm: bool = True,
    kernel: Kernel | None = None,
    documents: ShardedDocuments | None = None,
    exchange: str = "auto",
    steps: Mapping[str, Callable[..., Any]] | None = None,
) -> torch.Tensor:
    """The chunked gated delta rule over a sequence sharded across `group` (cp ranks).

    Inputs are this rank's tokens in layout order (chunk r, then chunk 2·cp−1−r, equal
    halves): `query`, `key` [batch, local_seq, k_heads, k_dim], `value` [batch,
    local_seq, v_heads, v_dim], `g`, `beta` [batch, local_seq, v_heads]. Returns the
    output [batch, local_seq, v_heads, v_dim] in `value`'s dtype, equal to the
    single-process rule on the whole sequence (zero initial state). With `documents`
    (packed rows) every document starts from a zero state, wherever it lies.
    Communication: the two chunk summaries, 2 × [batch, v_heads, k_dim, k_dim + v_dim]
    fp32, cross the ranks by `exchange` (`state_exchange.incoming_states`: one all-gather,
    or a log-depth scan from cp 8 on under "auto"); backward moves the same bytes back.
    `steps` may replace the local steps around the exchange (`summarise_halves`, `read_halves`:
    keys "cp_summarise", "cp_read"; `parallel.regional_compile` passes them compiled).
    """
    if documents is not None:
        return _cp_packed_gated_delta_rule(
            query, key, value, g, beta, documents, group=group, use_qk_l2norm=use_qk_l2norm, kernel=kernel,
            exchange=exchange,
        )
    steps = steps or {}
    local, readers = steps.get("cp_summarise", summarise_halves)(query, key, value, g, beta, use_qk_l2norm=use_qk_l2norm,
                                                                 kernel=kernel)
    states = incoming_states(local, group, key.shape[-1], exchange=exchange)
    return steps.get("cp_read", read_halves)(readers, states, value.dtype)


def summarise_halves(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    use_qk_l2norm: bool, kernel: Kernel | None,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """This rank's two layout chunks summarised, no communication (inputs as `cp_gated_delta_rule`'s):
    their [M | U] stacked, [2, batch, v_heads, k_dim, k_dim + v_dim] fp32, and each chunk's (o0, w)."""
    halves = [t.chunk(2, dim=1) for t in (query, key, value, g, beta)]
    summaries = [chunk_summary(*(h[slot] for h in halves), use_qk_l2norm=use_qk_l2norm, kernel=kernel) for slot in (0, 1)]
    return torch.stack([torch.cat([M, U], dim=-1) for _, _, M, U in summaries]), [(o0, w) for o0, w, _, _ in summaries]


def read_halves(
    readers: list[tuple[torch.Tensor, torch.Tensor]], states: list[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """Both chunks' outputs from their incoming states, [batch, local_seq, v_heads, v_dim] in `dtype`."""
    return torch.cat([read_state(o0, w, state) for (o0, w), state in zip(readers, states)], dim=1).to(dtype)


def _cp_packed_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: ShardedDocuments,
    *,
    group: dist.ProcessGroup,
    use_qk_l2norm: bool,
    kernel: Kernel | None,
    exchange: str,
) -> torch.Tensor:
    """`cp_gated_delta_rule` for packed rows (shapes as there).

    Each local chunk is cut into pieces at document starts; every piece is summarised
    alone (pieces grouped by length, as `ops.documents` does). Only a chunk's first piece
    can continue a document from before, so only it reads the incoming state (w ≠ 0),
    and the chunk passes its incoming state on (M = the piece's M) only when that piece
    is the whole chunk and not a start; otherwise M = 0 and U is the last piece's state.
    """
    batch, local_seq, v_heads, v_dim = value.shape
    k_dim, half = key.shape[-1], local_seq // 2
    starts = documents.starts
    piece, cu = documents.pieces

    def summarise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_: torch.Tensor, b: torch.Tensor):
        o0, w, M, U = chunk_summary(q, k, v, g_, b, use_qk_l2norm=use_qk_l2norm, kernel=kernel)
        return torch.cat([o0, w], dim=-1), torch.cat([M, U], dim=-1)

    flat = [t.reshape(batch * local_seq, *t.shape[2:]) for t in (query, key, value, g, beta)]
    per_token, per_piece = per_document_with_state(summarise, flat, cu)
    assert per_piece is not None
    o0, w = per_token.view(batch, local_seq, v_heads, v_dim + k_dim).split([v_dim, k_dim], dim=-1)
    first, last = piece[:, [0, half]], piece[:, [half - 1, local_seq - 1]]  # [batch, 2]
    passes_on = (first == last) & ~starts[:, [0, half]]
    M = per_piece[first][..., :k_dim] * passes_on[..., None, None, None]
    U = per_piece[last][..., k_dim:]
    states = incoming_states(torch.cat([M, U], dim=-1).transpose(0, 1), group, k_dim, exchange=exchange)
    outputs = []
    for slot, state in enumerate(states):
        part = slice(slot * half, (slot + 1) * half)
        reads = (starts[:, part].long().cumsum(dim=1) == 0)[..., None, None]  # still in the chunk's first piece
        outputs.append(read_state(o0[:, part], w[:, part] * reads, state))
    return torch.cat(outputs, dim=1).to(value.dtype)


def cp_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    group: dist.ProcessGroup,
    activation: str | None = "silu",
    documents: ShardedDocuments | None = None,
    kernel: ConvKernel | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d over a sequence sharded across `group`.

    `x` [batch, channels, local_seq] (this rank's two chunks in layout order), `weight`
    [channels, kernel]. Each chunk is convolved with the last kernel−1 inputs that
    precede it in the whole sequence (zeros before the start), also when chunks are
    shorter than the kernel. With `documents` (packed rows) a window never reaches before
    its token's document start. `kernel` (`ops.causal_conv.ConvKernel`, default
    `torch_conv_kernel`) convolves each chunk behind its halo, channel-last, with `seq_idx`
    for packed rows (FLA's conv: the same windows as `cu_seqlens`). Communication: one
    all-gather of 2 × [batch, channels, min(chunk, kernel−1)] per rank. Returns [batch,
    channels, local_seq] in `x`'s dtype.
    """
    kernel = kernel or torch_conv_kernel
    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    halo = weight.shape[-1] - 1
    chunks = x.chunk(2, dim=-1)
    tail = min(chunks[0].shape[-1], halo)
    gathered = all_gather_with_grad(torch.stack([c[..., c.shape[-1] - tail :] for c in chunks]), group)
    outputs = []
    if documents is None:
        windows: tuple[dict[str, Any], ...] = ({}, {})
    elif kernel is fla_conv_kernel:  # FLA's conv takes the segments, made once per forward
        windows = tuple({"cu_seqlens": segments} for segments in documents.conv_cu_seqlens(halo))
    else:
        windows = tuple({"seq_idx": seq_idx} for seq_idx in documents.conv_seq_idx(halo))
    for chunk_index, chunk, window in zip(rank_chunks(rank, cp), chunks, windows):
        # The halo: the last `halo` inputs of everything before this chunk; chunks shorter
        # than the halo need several predecessors.
        needed = -(-halo // tail) if tail else 0
        before = [gathered[chunk_owner(c, cp)] for c in range(max(0, chunk_index - needed), chunk_index)]
        context = torch.cat([x.new_zeros(*x.shape[:-1], halo), *before], dim=-1)[..., -halo:] if halo else x[..., :0]
        # Channel-last (stride 1 along channels), the layout causal-conv1d needs for seq_idx.
        padded = torch.cat([context.transpose(1, 2), chunk.transpose(1, 2)], dim=1).transpose(1, 2).to(weight.dtype)
        out = kernel(padded, weight, bias, activation=activation, **window)
        outputs.append(out[..., halo:].to(x.dtype))
    return torch.cat(outputs, dim=-1)


class ContextParallelGatedDeltaNet(Fp32GateGatedDeltaNet):
    """GatedDeltaNet whose forward runs over a sequence sharded across a cp group.

    Made by `install_context_parallel` (class swap of an `Fp32GateGatedDeltaNet`, no new
    weights). With `_cp_group` set, `hidden_states` [batch, local_seq, hidden] are this
    rank's two layout chunks and the output equals the single-process layer's output at
    those tokens. It runs `Fp32GateGatedDeltaNet.forward` with the conv and the rule
    across the group; without a group it is exactly that layer.
    """

    _cp_group: dist.ProcessGroup | None = None
    # How the chunk summaries cross the ranks: "auto", "allgather" or "scan"
    # (`state_exchange`); set it on the class or on one layer to force either.
    state_exchange: str = "auto"
    # The chunk kernel of the local chunks and their summaries (`ops.gated_delta.Kernel`),
    # chosen at the first CP forward from the device (`select_kernel`: FLA's on CUDA when
    # installed, else torch's) and kept; assign one to override.
    cp_kernel: Kernel | None = None
    # The conv's kernel (`ops.causal_conv.ConvKernel`), chosen alike (`select_conv_kernel`:
    # causal-conv1d's on CUDA when installed, else torch's) and kept; assign one to override.
    cp_conv_kernel: ConvKernel | None = None

    def check_call(self, cache: Any | None, kwargs: dict[str, Any]) -> None:
        if self._cp_group is None:
            return
        if cache is not None:
            raise NotImplementedError(
                "GatedDeltaNet under context parallelism does not support a cache (generation); run generation on a "
                "model without context parallelism."
            )
        # Packed rows arrive as `documents` (the CP pre-hook turns every form into it).
        # Right padding only (checked by shard_batch): zeroing padded tokens changes nothing
        # before them, exactly as in the single-process layer.

    def conv(self, mixed_qkv: torch.Tensor, cache: Any | None, kwargs: dict[str, Any]) -> torch.Tensor:
        if self._cp_group is None:
            return super().conv(mixed_qkv, cache, kwargs)
        if self.cp_conv_kernel is None:
            self.cp_conv_kernel = select_conv_kernel(mixed_qkv.device)
        return cp_causal_conv1d(
            mixed_qkv,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            group=self._cp_group,
            activation=self.activation,
            documents=kwargs.get(DOCUMENTS_KWARG),
            kernel=self.cp_conv_kernel,
        )

    def core(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cache: Any | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        if self._cp_group is None:
            return super().core(query, key, value, g, beta, cache, kwargs)
        if self.cp_kernel is None:
            self.cp_kernel = select_kernel(query.device)
        return cp_gated_delta_rule(
            query, key, value, g, beta, group=self._cp_group, documents=kwargs.get(DOCUMENTS_KWARG),
            exchange=self.state_exchange, kernel=self.cp_kernel, steps=self.__dict__.get(COMPILED_STEPS_ATTR),
        )


class ContextParallelMoeGatedDeltaNet(ContextParallelGatedDeltaNet, Fp32GateMoeGatedDeltaNet):
    """The MoE family's GatedDeltaNet under context parallelism: `ContextParallelGatedDeltaNet`'s
    code (the families' layers are one source, `Fp32GateMoeGatedDeltaNet`), the MoE class kept."""


class ContextParallelQwen3NextGatedDeltaNet(ContextParallelGatedDeltaNet, Fp32GateQwen3NextGatedDeltaNet):
    """Qwen3-Next's GatedDeltaNet under context parallelism: `ContextParallelGatedDeltaNet`'s conv and
    rule across the ranks after Qwen3-Next's own projections (`Fp32GateQwen3NextGatedDeltaNet._project`)."""
