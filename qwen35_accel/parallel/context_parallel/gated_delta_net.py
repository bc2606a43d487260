"""GatedDeltaNet under context parallelism: state passing and a conv halo, nothing more.

Each rank holds two chunks of the sequence (see `layout`). The recurrence crosses chunk
boundaries through the state alone: every chunk is summarised as an affine map of its
incoming state (`ops.gated_delta.chunk_summary`), the summaries are all-gathered (their
size depends on heads and head dims, not on the sequence), every rank folds them in
sequence order, and each chunk reads its incoming state. The depthwise causal conv needs
the last K−1 pre-conv inputs before each chunk: a halo, also independent of the sequence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ...model.fp32_gate import Fp32GateGatedDeltaNet
from ...ops.gated_delta import Kernel, chunk_summary, fold_states, read_state
from .collectives import all_gather_with_grad
from .layout import chunk_owner, rank_chunks


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
) -> torch.Tensor:
    """The chunked gated delta rule over a sequence sharded across `group` (cp ranks).

    Inputs are this rank's tokens in layout order (chunk r, then chunk 2·cp−1−r, equal
    halves): `query`, `key` [batch, local_seq, k_heads, k_dim], `value` [batch,
    local_seq, v_heads, v_dim], `g`, `beta` [batch, local_seq, v_heads]. Returns the
    output [batch, local_seq, v_heads, v_dim] in `value`'s dtype, equal to the
    single-process rule on the whole sequence (zero initial state). Communication: one
    all-gather of 2 × [batch, v_heads, k_dim, k_dim + v_dim] fp32 per rank (and its
    reduce in backward).
    """
    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    halves = [t.chunk(2, dim=1) for t in (query, key, value, g, beta)]
    summaries = [chunk_summary(*(h[slot] for h in halves), use_qk_l2norm=use_qk_l2norm, kernel=kernel) for slot in (0, 1)]
    # [2, batch, v_heads, k_dim, k_dim + v_dim] -> gathered [cp, 2, …]
    local = torch.stack([torch.cat([M, U], dim=-1) for _, _, M, U in summaries])
    gathered = all_gather_with_grad(local, group)
    k_dim = key.shape[-1]
    transitions, updates = [], []
    for chunk in range(2 * cp):
        owner, slot = chunk_owner(chunk, cp)
        M, U = gathered[owner, slot].split([k_dim, gathered.shape[-1] - k_dim], dim=-1)
        transitions.append(M)
        updates.append(U)
    states = fold_states(transitions, updates)
    outputs = [read_state(o0, w, states[chunk]) for (o0, w, _, _), chunk in zip(summaries, rank_chunks(rank, cp))]
    return torch.cat(outputs, dim=1).to(value.dtype)


def cp_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    group: dist.ProcessGroup,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv1d over a sequence sharded across `group`.

    `x` [batch, channels, local_seq] (this rank's two chunks in layout order), `weight`
    [channels, kernel]. Each chunk is convolved with the last kernel−1 inputs that
    precede it in the whole sequence (zeros before the start), also when chunks are
    shorter than the kernel. Communication: one all-gather of 2 × [batch, channels,
    min(chunk, kernel−1)] per rank. Returns [batch, channels, local_seq] in `x`'s dtype.
    """
    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    halo = weight.shape[-1] - 1
    chunks = x.chunk(2, dim=-1)
    tail = min(chunks[0].shape[-1], halo)
    gathered = all_gather_with_grad(torch.stack([c[..., c.shape[-1] - tail :] for c in chunks]), group)
    outputs = []
    for chunk_index, chunk in zip(rank_chunks(rank, cp), chunks):
        # The halo: the last `halo` inputs of everything before this chunk; chunks shorter
        # than the halo need several predecessors.
        needed = -(-halo // tail) if tail else 0
        before = [gathered[chunk_owner(c, cp)] for c in range(max(0, chunk_index - needed), chunk_index)]
        context = torch.cat([x.new_zeros(*x.shape[:-1], halo), *before], dim=-1)[..., -halo:] if halo else x[..., :0]
        padded = torch.cat([context, chunk], dim=-1).to(weight.dtype)
        out = F.conv1d(padded, weight.unsqueeze(1), bias, groups=x.shape[1])
        if activation is not None:
            out = ACT2FN[activation](out)
        outputs.append(out.to(x.dtype))
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

    def check_call(self, cache: Any | None, kwargs: dict[str, Any]) -> None:
        if self._cp_group is None:
            return
        if cache is not None:
            raise NotImplementedError(
                "GatedDeltaNet under context parallelism does not support a cache (generation); run generation on a "
                "model without context parallelism."
            )
        if kwargs.get("cu_seq_lens_q") is not None:
            raise NotImplementedError("packed sequences (cu_seq_lens_q) are not supported under context parallelism")
        # Right padding only (checked by shard_batch): zeroing padded tokens changes nothing
        # before them, exactly as in the single-process layer.

    def conv(self, mixed_qkv: torch.Tensor, cache: Any | None, kwargs: dict[str, Any]) -> torch.Tensor:
        if self._cp_group is None:
            return super().conv(mixed_qkv, cache, kwargs)
        return cp_causal_conv1d(
            mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, group=self._cp_group, activation=self.activation
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
        return cp_gated_delta_rule(query, key, value, g, beta, group=self._cp_group)
