"""Qwen3.5's gated full attention under context parallelism: an all-gather of K and V.

Every rank all-gathers the (GQA-sized, post-norm, post-rotary) keys and values of the
cp group, restores sequence order, and attends each of its two query chunks causally by
global position to the keys up to that chunk's end (packed rows: each document's piece of
a chunk to its document's keys, so no [queries, keys] mask is built). Queries, the output gate and
`o_proj` stay local. Positions travel with the tokens (rotary comes from the sharded
global `position_ids`), so partial and multimodal RoPE need nothing extra.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from ...model.fp32_gate import COMPILED_STEPS_ATTR
from ..collectives import all_gather_with_grad
from .sharded_documents import DOCUMENTS_KWARG, ShardedDocuments
from .chunks import rank_chunks, unshard_sequence

# Attention implementations whose causal alignment is exact here: SDPA with a lower-right
# causal bias, eager with an additive mask. Flash-attention kernels are not wired yet.
SUPPORTED_ATTENTION = ("sdpa", "eager")


def _chunk_mask(chunk_len: int, chunk_index: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [1, 1, chunk_len, (chunk_index+1)·chunk_len] mask (eager attention): query i
    of chunk `chunk_index` sees the keys up to its global index."""
    keys = (chunk_index + 1) * chunk_len
    query_pos = chunk_index * chunk_len + torch.arange(chunk_len, device=device)
    allowed = torch.arange(keys, device=device)[None, :] <= query_pos[:, None]
    return torch.zeros(chunk_len, keys, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def _sdpa_causal_lower_right(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scaling: float
) -> torch.Tensor:
    """Causal SDPA with the queries aligned to the end of the keys: flash and memory-efficient
    kernels take it without a [queries, keys] mask. Returns [batch, heads, queries, dim]."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), dropout_p=dropout, scale=scaling,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def _document_mask(query_index: torch.Tensor, doc_start: torch.Tensor, first_key: int, end: int) -> torch.Tensor:
    """[batch, 1, queries, end − first_key] bool: query i (global index `query_index[i]`,
    document starting at `doc_start[:, i]`) sees keys from its document's start to itself."""
    keys = torch.arange(first_key, end, device=query_index.device)
    return ((keys[None, None, :] >= doc_start[:, :, None]) & (keys[None, None, :] <= query_index[None, :, None]))[:, None]


def _sdpa_documents(
    query: torch.Tensor,
    full_key: torch.Tensor,
    full_value: torch.Tensor,
    pieces: tuple[tuple[int, int, int, int, int], ...],
    dropout: float,
    scaling: float,
) -> torch.Tensor:
    """Packed rows: each piece of the local queries (one document's tokens within one chunk,
    `ShardedDocuments.attention_pieces`) attends causally, aligned to the end, to its
    document's keys up to its last query — exactly the document attended alone.

    `query` [batch, heads, local_seq, dim], `full_key`/`full_value` [batch, kv_heads, seq,
    dim] (the whole rows). Returns [batch, heads, local_seq, dim]. No [queries, keys] mask
    exists: with a lower-right causal bias SDPA takes the flash kernel on CUDA (GQA
    included), so memory grows with the tokens, not their square, however many documents.
    """
    outputs = [
        _sdpa_causal_lower_right(
            query[row : row + 1, :, first:end], full_key[row : row + 1, :, key_first:key_end],
            full_value[row : row + 1, :, key_first:key_end], dropout, scaling,
        )
        for row, first, end, key_first, key_end in pieces
    ]
    batch, heads, local_seq, dim = query.shape
    # Pieces come row after row, in token order: [1, heads, batch·local_seq, dim] -> per row.
    return torch.cat(outputs, dim=2).view(heads, batch, local_seq, dim).transpose(0, 1)


def _sdpa_chunks(
    query: torch.Tensor, full_key: torch.Tensor, full_value: torch.Tensor, rank: int, cp: int, dropout: float, scaling: float
) -> torch.Tensor:
    """Each of this rank's two query chunks over the keys up to its end, causal and aligned
    to the end. [batch, heads, local_seq, dim] in and out."""
    chunk_len = query.shape[2] // 2
    outputs = []
    for slot, chunk_index in enumerate(rank_chunks(rank, cp)):
        end = (chunk_index + 1) * chunk_len
        q = query[:, :, slot * chunk_len : (slot + 1) * chunk_len]
        outputs.append(_sdpa_causal_lower_right(q, full_key[:, :, :end], full_value[:, :, :end], dropout, scaling))
    return torch.cat(outputs, dim=2)


def _sdpa(
    query: torch.Tensor,
    full_key: torch.Tensor,
    full_value: torch.Tensor,
    rank: int,
    cp: int,
    documents: ShardedDocuments | None,
    dropout: float,
    scaling: float,
) -> torch.Tensor:
    """SDPA under CP, whole rows or packed: [batch, local_seq, heads, dim]."""
    if documents is None:
        attend, args = _sdpa_chunks, (query, full_key, full_value, rank, cp, dropout, scaling)
    else:
        attend, args = _sdpa_documents, (query, full_key, full_value, documents.attention_pieces, dropout, scaling)
    if query.device.type == "cpu" and torch.is_grad_enabled() and dropout == 0.0:
        # The CPU kernels materialise each [queries, keys] causal mask and keep the scores
        # for backward; recomputing the attention in backward keeps only q, k, v. (CUDA's
        # flash kernel keeps neither: no recompute there.)
        return torch.utils.checkpoint.checkpoint(attend, *args, use_reentrant=False).transpose(1, 2)
    return attend(*args).transpose(1, 2)


def cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    implementation: str,
    scaling: float,
    dropout: float = 0.0,
    documents: ShardedDocuments | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sharded sequence.

    `query` [batch, heads, local_seq, head_dim], `key`/`value` [batch, kv_heads,
    local_seq, head_dim], local tokens in layout order (two equal chunks). With
    `documents` (packed rows) a query sees only the keys of its own document, and keys
    before the earliest document start among a chunk's queries are not computed. Returns
    [batch, local_seq, heads, head_dim] like Transformers' attention functions.
    Communication: one all-gather of K and V ([2, batch, kv_heads, local_seq, head_dim]
    per rank) and its reduction in backward.
    """
    if implementation not in SUPPORTED_ATTENTION:
        raise NotImplementedError(
            f"attention implementation {implementation!r} is not supported under context parallelism; "
            f"load the model with attn_implementation in {SUPPORTED_ATTENTION}"
        )
    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    gathered = all_gather_with_grad(torch.stack([key, value]), group)  # [cp, 2, batch, kv_heads, local_seq, dim]
    full_key, full_value = unshard_sequence(list(gathered.unbind(0)), cp, seq_dim=3).unbind(0)
    if implementation == "sdpa":
        return _sdpa(query, full_key, full_value, rank, cp, documents, dropout, scaling)
    chunk_len = query.shape[2] // 2
    outputs = []
    interface = hf.ALL_ATTENTION_FUNCTIONS.get_interface(implementation, hf.eager_attention_forward)
    for slot, chunk_index in enumerate(rank_chunks(rank, cp)):
        end = (chunk_index + 1) * chunk_len
        part = slice(slot * chunk_len, (slot + 1) * chunk_len)
        first_key = 0 if documents is None else documents.first_keys[slot]
        k, v = full_key[:, :, first_key:end], full_value[:, :, first_key:end]
        if documents is None:
            additive = _chunk_mask(chunk_len, chunk_index, query.dtype, query.device)
        else:
            mask = _document_mask(documents.index[part], documents.doc_start[:, part], first_key, end)
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, torch.finfo(query.dtype).min)
        out, _ = interface(module, query[:, :, part], k, v, additive, dropout=dropout, scaling=scaling, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1)


class ContextParallelAttention(hf.Qwen3_5Attention):
    """Qwen3_5Attention whose attention spans a sequence sharded across a cp group.

    Made by `install_context_parallel` (class swap, no new weights). With `_cp_group`
    set, inputs are this rank's two layout chunks with their global rotary embeddings;
    the output equals the single-process layer's at those tokens. The incoming
    `attention_mask` is not used: right padding (the only padding CP accepts) never
    precedes a real token, so causality alone gives the real tokens' outputs.
    """

    _cp_group: dist.ProcessGroup | None = None

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Any | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        group = self._cp_group
        if group is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        if cache is not None or kwargs.get("past_key_values") is not None:
            raise NotImplementedError(
                "attention under context parallelism does not support a cache (generation); run generation on a model "
                "without context parallelism."
            )
        # torch.compile'd per layer (`parallel.regional_compile`): the steps around the K/V exchange.
        steps = self.__dict__.get(COMPILED_STEPS_ATTR) or {}
        query_states, key_states, value_states, gate = steps.get("cp_project", self._cp_project)(hidden_states, *position_embeddings)
        attn_output = cp_attention(
            self,
            query_states,
            key_states,
            value_states,
            group=group,
            implementation=self.config._attn_implementation,
            scaling=self.scaling,
            dropout=0.0 if not self.training else self.attention_dropout,
            documents=kwargs.pop(DOCUMENTS_KWARG, None),
            **kwargs,
        )
        return steps.get("cp_output", self._cp_output)(attn_output, gate), None

    def _cp_project(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Transformers' steps before attention: [batch, seq, hidden] -> query [batch, heads, seq,
        head_dim], key and value [batch, kv_heads, seq, head_dim] (normed, rotated), the output gate
        [batch, seq, heads · head_dim]."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states, gate = torch.chunk(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
        query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states, key_states = hf.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states, value_states, gate

    def _cp_output(self, attn_output: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Transformers' steps after attention: the gated `o_proj` of attn_output [batch, seq, heads,
        head_dim] -> [batch, seq, hidden]."""
        attn_output = attn_output.reshape(*gate.shape[:-1], -1).contiguous()
        return self.o_proj(attn_output * torch.sigmoid(gate))


class ContextParallelMoeAttention(ContextParallelAttention, hf_moe.Qwen3_5MoeAttention):
    """The MoE family's attention under context parallelism: `ContextParallelAttention`'s code
    (Transformers' MoE attention is the dense source with the names mapped, `tests/test_moe.py`)."""


class ContextParallelQwen3NextAttention(ContextParallelAttention, hf_next.Qwen3NextAttention):
    """Qwen3-Next's gated attention under context parallelism: `ContextParallelAttention`'s code
    (Transformers' Qwen3-Next attention is Qwen3.5's op for op, `tests/test_qwen3_next.py`)."""
