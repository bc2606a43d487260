"""Putting a dense Qwen3.5 model under context parallelism: layers, loss, input checks.

`install_context_parallel(model, cp_mesh)` swaps the classes of the text decoder's
GatedDeltaNet and attention modules for their CP-aware subclasses (no new weights, same
state-dict keys), gives them the cp group, installs a loss that reduces over the cp
group, and checks every forward's inputs. From then on the model expects each rank's
part of the batch (`qwen35_accel.context_parallel.shard_batch`, or the Accelerate
integration's per-step sharding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from ...model.detect import FAMILIES, Qwen35Parts, head_backbone, qwen35_parts
from ...model.fp32_gate import GATED_DELTA_NET_CLASSES, Fp32GateGatedDeltaNet
from ...model.hub_kernels import swap_class
from ...model.packing import (
    SEQUENCE_SHARDED_ATTR,
    document_layout,
    refuse_packed_rows_of_a_sequence_classifier,
    text_positions,
)
from ...model.state import own_state, state_of
from ...ops.causal_conv import fla_conv_kernel, select_conv_kernel
from ..collectives import all_gather_flat
from ..losses import CausalLMLoss
from .attention import (
    SUPPORTED_ATTENTION,
    ContextParallelAttention,
    ContextParallelMoeAttention,
    ContextParallelQwen3NextAttention,
)
from .sharded_documents import DOCUMENTS_KWARG, ShardedDocuments, shard_documents
from .heads import install_context_parallel_head
from .gated_delta_net import (
    ContextParallelGatedDeltaNet,
    ContextParallelMoeGatedDeltaNet,
    ContextParallelQwen3NextGatedDeltaNet,
)
from .chunks import chunk_owner, unshard_sequence
from .state_exchange import EXCHANGES
from .vision_split import install_context_parallel_vision

_VISION_INPUTS = ("pixel_values", "pixel_values_videos")
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _padding_violation(attention_mask: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether a padded token precedes a real one (left padding or holes) anywhere in the
    cp group's sequence. Each rank summarises its two chunks (a local violation, first and
    last mask value of each, its local length); one small all-gather lets every rank check the
    chunk boundaries too, so all ranks reach the same verdict (none raises alone and leaves the
    others waiting). ValueError on every rank when the ranks' local lengths differ: they were
    given different batches, not chunks of the same rows."""
    cp = dist.get_world_size(group)
    rows = attention_mask.shape[0]
    mask = attention_mask.long()
    summary = torch.zeros(rows, 2, 3, dtype=torch.long, device=mask.device)  # per chunk: bad, first, last
    summary[:, 0, 0] = (mask[:, 1:] > mask[:, :-1]).any(dim=1).long()
    summary[:, 1, 0] = mask.shape[1]  # the local length, compared across the ranks
    for slot, half in enumerate(mask.chunk(2, dim=1)):
        summary[:, slot, 1], summary[:, slot, 2] = half[:, 0], half[:, -1]
    gathered = torch.empty(cp * rows, 2, 3, dtype=summary.dtype, device=mask.device)
    all_gather_flat(gathered, summary, group=group)
    gathered = gathered.view(cp, rows, 2, 3)
    lengths = gathered[:, 0, 1, 0]
    chunks = [gathered[owner, :, slot] for owner, slot in (chunk_owner(c, cp) for c in range(2 * cp))]  # sequence order
    # A token after padding across a chunk boundary too; one host sync for all of it.
    across = torch.stack([(b[:, 1] > a[:, 2]) for a, b in zip(chunks, chunks[1:])])
    differ, bad = torch.stack([(lengths != lengths[0]).any(), gathered[..., 0, 0].any() | across.any()]).tolist()
    if differ:
        raise ValueError(
            f"the ranks of a cp group were given different batches (local lengths {lengths.tolist()} on its ranks "
            f"0..{cp - 1}, {rows} rows each): under context parallelism every rank of a cp group holds its chunks "
            "of the same rows. Give the ranks of a cp group the same batch (Accelerate's prepared dataloader does; a "
            "framework's own sampler must split the data by data-parallel rank, not by process), then shard it "
            "(the Trainer's CP preparation, or qwen35_accel.context_parallel.shard_batch)."
        )
    return bool(bad)


def _sharded_documents(
    position_ids: torch.Tensor, kwargs: dict[str, Any], rows: int, group: dist.ProcessGroup
) -> ShardedDocuments | None:
    """This rank's view of the packed rows, or None when every row is one document.

    The local text positions are all-gathered (one [rows, local_seq] long per rank) and
    the whole rows' boundaries found as without CP, checked against `cu_seq_lens_*` and
    `seq_idx` (whole-row, as `shard_batch` and the Trainer leave them): every rank sees
    the same whole rows, so every rank raises the same error for forms that disagree.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    text = text_positions(position_ids, rows)
    if text is None and all(kwargs.get(key) is None for key in _PACKING_KWARGS):
        return None
    whole = None
    if text is not None:
        local = text.long().contiguous()
        gathered = torch.empty(cp * rows, local.shape[1], dtype=local.dtype, device=local.device)
        all_gather_flat(gathered, local, group=group)
        whole = unshard_sequence(list(gathered.view(cp, rows, -1).unbind(0)), cp, seq_dim=1)
    seq = (whole.shape[1] if whole is not None else position_ids.shape[-1] * cp)
    layout = document_layout(
        rows,
        seq,
        position_ids=whole,
        cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
        cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
        seq_idx=kwargs.get("seq_idx"),
    )
    if layout is None:
        return None
    return shard_documents(layout.starts(rows, seq), cp, rank)


def _check_inputs(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if state_of(module).cp_paused:
        return None
    for key in ("cache", "past_key_values"):
        if kwargs.get(key) is not None:
            raise NotImplementedError("a cache (generation) is not supported under context parallelism.")
    # A cache made here would hold only this rank's chunks.
    kwargs["use_cache"] = False
    _check_router_loss(module, args, kwargs)
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None and args:
        tokens = args[0]
    if tokens is not None and tokens.shape[1] % 2:
        raise ValueError(
            f"under context parallelism each rank holds two equal chunks of the sequence, but the local length is "
            f"{tokens.shape[1]} (odd). Shard batches with qwen35_accel.context_parallel.shard_batch."
        )
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError(
            "under context parallelism pass `position_ids` holding each local token's global position (the model "
            "would number the local tokens from 0); qwen35_accel.context_parallel.shard_batch adds them."
        )
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None and head_backbone(module) is None:
        raise ValueError(
            "under context parallelism pass `shift_labels` with `labels` (labels cannot be shifted inside a chunk); "
            "qwen35_accel.context_parallel.shard_batch adds them."
        )
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError("under context parallelism attention_mask must be a 2-D padding mask [batch, seq]")
    group = state_of(module).cp_mesh.get_group()
    if attention_mask is not None and _padding_violation(attention_mask, group):
        raise ValueError(
            "context parallelism supports right padding only; this attention_mask has a padded token before a real "
            "one (left padding or holes). Use padding_side='right' in the tokenizer/collator."
        )
    rows = (tokens if tokens is not None else attention_mask if attention_mask is not None else position_ids).shape[0]
    documents = _sharded_documents(position_ids, kwargs, rows, group)
    vision = [key for key in _VISION_INPUTS if kwargs.get(key) is not None]
    if documents is not None and vision:  # the verdict of the whole rows: every rank raises
        raise NotImplementedError(
            f"packed rows (several documents per row) with images or videos are not supported under context "
            f"parallelism (got {', '.join(vision)} with position_ids restarting, cu_seq_lens_* or seq_idx): the "
            "multimodal RoPE positions Transformers computes run across a whole row, not per document. Pad the rows "
            "instead of packing them (one sample per row), or pack text-only data."
        )
    if documents is not None and isinstance(module, GenericForSequenceClassification):  # every rank: whole rows
        refuse_packed_rows_of_a_sequence_classifier("position_ids restarting inside a row, cu_seq_lens_* or seq_idx")
    for key in _PACKING_KWARGS:  # whole-row forms: the layers read `documents`
        kwargs.pop(key, None)
    if documents is not None:
        device = (tokens if tokens is not None else position_ids).device
        documents.precompute(module.config.linear_conv_kernel_dim - 1, select_conv_kernel(device) is fla_conv_kernel,
                             sdpa=module.config._attn_implementation == "sdpa")
        kwargs[DOCUMENTS_KWARG] = documents
    # The layers take their masks from here, not from the text model: CP attention masks by
    # global position and document itself, and Transformers would otherwise build a
    # [local_seq, local_seq] mask from the local positions (which jump between the two
    # chunks) that nothing reads. GatedDeltaNet zeroes right-padded tokens as it would.
    padding = attention_mask if attention_mask is not None and not bool(attention_mask.bool().all()) else None
    kwargs["attention_mask"] = {"full_attention": None, "linear_attention": padding}
    return args, kwargs


def _check_router_loss(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A MoE forward whose router's load-balancing loss Transformers would compute from this
    rank's chunks alone (anything but the tiled training loss, which reduces its sums over
    the cp group) is refused: its value would differ on every rank and from one process."""
    requested = kwargs.get("output_router_logits")
    if requested is None:
        requested = getattr(module.config, "output_router_logits", False)
    if not requested:
        return
    if kwargs.get("fused_lm_head") and getattr(module.forward, "_qwen35_accel_fused_head", False):
        return  # TRL's fused head, wrapped: it reduces the router loss's sums over the cp group itself
    from ..tiled_loss import _tiled_loss_applies

    if not _tiled_loss_applies(module, args, kwargs):
        raise NotImplementedError(
            "under context parallelism a MoE router's load-balancing loss (output_router_logits) is exact "
            "only in the tiled training loss (labels given, autograd recording, QWEN35_ACCEL_TILED_LOSS not off); "
            "this forward would compute it from this rank's chunks. Pass output_router_logits=False to evaluation "
            "and generation forwards, or set it in the config only for training."
        )


def check_context_parallel_supported(model: nn.Module) -> None:
    """Raise NotImplementedError if `model`'s attention implementation cannot run under CP."""
    config = getattr(model.config, "text_config", model.config)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTENTION:
        raise NotImplementedError(
            f"context parallelism supports attn_implementation in {SUPPORTED_ATTENTION}; this model uses "
            f"{implementation!r}. Load it with attn_implementation='sdpa'."
        )


def install_context_parallel(
    model: nn.Module, cp_mesh: DeviceMesh, *, state_exchange: str = "auto", parts: Qwen35Parts | None = None
) -> int:
    """Put a Qwen3.5 model's text decoder (dense, or MoE: its causal LM) under context
    parallelism over `cp_mesh`.

    Preconditions: fp32 gate holders installed (`install_fp32_gate`); attention
    implementation in `SUPPORTED_ATTENTION`. Works before or after FSDP2 sharding.
    `state_exchange` ("auto", "allgather", "scan"): how the GatedDeltaNet layers pass their
    chunk summaries across ranks (`state_exchange.py`; "auto" picks by cp size and backend).
    Returns the number of token-mixing layers made CP-aware. Sets `model.loss_function`
    (an instance attribute; the class is untouched) and a forward pre-hook that rejects
    inputs CP cannot handle exactly; a VLM's images and videos are encoded with the tower's
    work split over the cp ranks (`install_context_parallel_vision`). `parts`: `model`'s, when the
    caller located them already (`PARALLELIZER.apply`).
    """
    parts = parts or qwen35_parts(model, families=FAMILIES)
    check_context_parallel_supported(model)
    # Each family's CP layers: the same code, its Transformers classes kept.
    gated_delta_net, attention = {
        "dense": (ContextParallelGatedDeltaNet, ContextParallelAttention),
        "moe": (ContextParallelMoeGatedDeltaNet, ContextParallelMoeAttention),
        "next": (ContextParallelQwen3NextGatedDeltaNet, ContextParallelQwen3NextAttention),
    }[parts.family]
    if state_exchange not in EXCHANGES:
        raise ValueError(f"state_exchange={state_exchange!r}: expected one of {list(EXCHANGES)}")
    group = cp_mesh.get_group()
    converted = 0
    for layer in parts.decoder_layers:
        for module in layer.modules():
            if isinstance(module, GATED_DELTA_NET_CLASSES):
                if not isinstance(module, Fp32GateGatedDeltaNet):
                    raise ValueError("install_fp32_gate must run before install_context_parallel")
                swap_class(module, gated_delta_net)
                module.state_exchange = state_exchange
            elif isinstance(module, (hf.Qwen3_5Attention, hf_moe.Qwen3_5MoeAttention, hf_next.Qwen3NextAttention)):
                swap_class(module, attention)
            else:
                continue
            module._cp_group = group
            converted += 1
    if not install_context_parallel_head(model, group):  # a classification head: its own CP forward and loss
        model.loss_function = CausalLMLoss(cp_group=group, vocab_group=state_of(model).vocab_group)
    model.register_forward_pre_hook(_check_inputs, with_kwargs=True)
    if parts.vision_model is not None:  # images and videos: the tower's work split over the cp ranks
        install_context_parallel_vision(model, group)
    state = own_state(model)
    state.cp_mesh, state.cp_text_model = cp_mesh, parts.text_model
    # The text decoder sees this rank's chunks, not packed rows: its packing hook stands aside.
    parts.text_model.__dict__[SEQUENCE_SHARDED_ATTR] = True
    return converted


def context_parallel_mesh(model: nn.Module) -> DeviceMesh | None:
    """The cp mesh `install_context_parallel` put on `model`, or None (also while paused)."""
    state = state_of(model)
    return None if state.cp_paused else state.cp_mesh


@contextlib.contextmanager
def context_parallel_paused(model: nn.Module) -> Iterator[bool]:
    """For the duration, a model under context parallelism computes as without it: every rank
    runs whole sequences (any padding, caches: generation), its CP layers as the layers they
    were made from, the input checks and the text model's packing hook as stock. Collective
    work is FSDP2's alone (each rank gathers its units as in any forward), so every rank of
    the mesh must run the same number of forwards, as in data-parallel generation.

    `model`: the model `install_context_parallel` was given or one holding it (a PEFT or
    Accelerate wrapper). Yields whether anything was paused (False without CP). Not reentrant
    across threads; nested use is a no-op."""
    found = {id(s): s for m in model.modules() if (s := state_of(m)).cp_mesh is not None}
    holders = [state for state in found.values() if not state.cp_paused]
    if not holders:
        yield False
        return
    layers = [m for m in model.modules() if "_cp_group" in m.__dict__]
    groups = [m.__dict__.pop("_cp_group") for m in layers]  # the class default: None, the stock layer
    for holder in holders:
        holder.cp_paused = True
        holder.cp_text_model.__dict__[SEQUENCE_SHARDED_ATTR] = False
    try:
        yield True
    finally:
        for layer, group in zip(layers, groups):
            layer._cp_group = group
        for holder in holders:
            holder.cp_paused = False
            holder.cp_text_model.__dict__[SEQUENCE_SHARDED_ATTR] = True
