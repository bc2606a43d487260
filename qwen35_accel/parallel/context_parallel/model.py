"""Putting a dense Qwen3.5 model under context parallelism: layers, loss, input checks.

`install_context_parallel(model, cp_mesh)` swaps the classes of the text decoder's
GatedDeltaNet and attention modules for their CP-aware subclasses (no new weights, same
state-dict keys), gives them the cp group, installs a loss that reduces over the cp
group, and checks every forward's inputs. From then on the model expects each rank's
part of the batch (`qwen35_accel.context_parallel.shard_batch`, or the Accelerate
integration's per-step sharding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ...model.detect import qwen35_parts
from ...model.fp32_gate import Fp32GateGatedDeltaNet
from ...model.packing import SEQUENCE_SHARDED_ATTR
from ..losses import VOCAB_GROUP_ATTR, CausalLMLoss
from .attention import SUPPORTED_ATTENTION, ContextParallelAttention
from .gated_delta_net import ContextParallelGatedDeltaNet

CP_MESH_ATTR = "_qwen35_cp_mesh"


_UNSUPPORTED_INPUTS = {
    "pixel_values": "images",
    "pixel_values_videos": "videos",
    "cu_seq_lens_q": "packed sequences (cu_seq_lens_q)",
}


def _layout_violations(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, group: dist.ProcessGroup
) -> tuple[bool, bool]:
    """(left padding or holes, positions that jump) anywhere in the cp group's sequence.

    Each rank summarises its two chunks (local violations, first/last mask and position of
    each chunk); one small all-gather lets every rank check the chunk boundaries too, so
    all ranks reach the same verdict (no rank raises alone and leaves the others waiting).
    """
    cp = dist.get_world_size(group)
    rows = (attention_mask if attention_mask is not None else position_ids).shape[0]
    device = (attention_mask if attention_mask is not None else position_ids).device
    summary = torch.zeros(rows, 2, 6, dtype=torch.long, device=device)  # per chunk: bad_pad, bad_pos, mask0, maskN, pos0, posN
    if attention_mask is not None:
        halves = attention_mask.long().chunk(2, dim=1)
        whole = attention_mask.long()
        summary[:, 0, 0] = (whole[:, 1:] > whole[:, :-1]).any(dim=1).long()  # a 0 before a 1, in sequence order
        for slot, half in enumerate(halves):
            summary[:, slot, 2], summary[:, slot, 3] = half[:, 0], half[:, -1]
    else:
        summary[:, :, 2:4] = 1
    if position_ids is not None and position_ids.dim() == 2:
        for slot, half in enumerate(position_ids.long().chunk(2, dim=1)):
            summary[:, slot, 1] = (half[:, 1:] - half[:, :-1] != 1).any(dim=1).long()
            summary[:, slot, 4], summary[:, slot, 5] = half[:, 0], half[:, -1]
    gathered = torch.empty(cp * rows, 2, 6, dtype=summary.dtype, device=device)
    dist.all_gather_into_tensor(gathered, summary, group=group)
    gathered = gathered.view(cp, rows, 2, 6)
    from .layout import chunk_owner

    chunks = [gathered[owner, :, slot] for owner, slot in (chunk_owner(c, cp) for c in range(2 * cp))]  # [rows, 6], sequence order
    bad_pad = bool(gathered[..., 0].any())
    bad_pos = bool(gathered[..., 1].any())
    for before, after in zip(chunks, chunks[1:]):
        bad_pad |= bool((after[:, 2] > before[:, 3]).any())
        if position_ids is not None and position_ids.dim() == 2:
            bad_pos |= bool((after[:, 4] - before[:, 5] != 1).any())
    return bad_pad, bad_pos


def _check_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    for key, what in _UNSUPPORTED_INPUTS.items():
        if kwargs.get(key) is not None:
            raise NotImplementedError(f"{what} are not supported under context parallelism yet; got `{key}`.")
    for key in ("cache", "past_key_values"):
        if kwargs.get(key) is not None:
            raise NotImplementedError("a cache (generation) is not supported under context parallelism.")
    # A cache made here would hold only this rank's chunks.
    kwargs["use_cache"] = False
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
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(
            "under context parallelism pass `shift_labels` with `labels` (labels cannot be shifted inside a chunk); "
            "qwen35_accel.context_parallel.shard_batch adds them."
        )
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError("under context parallelism attention_mask must be a 2-D padding mask [batch, seq]")
    bad_pad, bad_pos = _layout_violations(position_ids, attention_mask, getattr(module, CP_MESH_ATTR).get_group())
    if bad_pad:
        raise ValueError(
            "context parallelism supports right padding only; this attention_mask has a padded token before a real "
            "one (left padding or holes). Use padding_side='right' in the tokenizer/collator."
        )
    if bad_pos:
        raise ValueError(
            "position_ids restart or jump inside a row (packed sequences); context parallelism does not support packed "
            "sequences yet. Disable packing (e.g. padding-free collators) for CP runs."
        )
    return args, kwargs


def check_context_parallel_supported(model: nn.Module) -> None:
    """Raise NotImplementedError if `model`'s attention implementation cannot run under CP."""
    config = getattr(model.config, "text_config", model.config)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTENTION:
        raise NotImplementedError(
            f"context parallelism supports attn_implementation in {SUPPORTED_ATTENTION}; this model uses "
            f"{implementation!r}. Load it with attn_implementation='sdpa'."
        )


def install_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> int:
    """Put a dense Qwen3.5 model's text decoder under context parallelism over `cp_mesh`.

    Preconditions: fp32 gate holders installed (`install_fp32_gate`); attention
    implementation in `SUPPORTED_ATTENTION`. Works before or after FSDP2 sharding.
    Returns the number of token-mixing layers made CP-aware. Sets `model.loss_function`
    (an instance attribute; the class is untouched) and a forward pre-hook that rejects
    inputs CP cannot handle exactly.
    """
    parts = qwen35_parts(model)
    check_context_parallel_supported(model)
    group = cp_mesh.get_group()
    converted = 0
    for layer in parts.decoder_layers:
        for module in layer.modules():
            if isinstance(module, hf.Qwen3_5GatedDeltaNet):
                if not isinstance(module, Fp32GateGatedDeltaNet):
                    raise ValueError("install_fp32_gate must run before install_context_parallel")
                module.__class__ = ContextParallelGatedDeltaNet
            elif isinstance(module, hf.Qwen3_5Attention):
                module.__class__ = ContextParallelAttention
            else:
                continue
            module._cp_group = group
            converted += 1
    model.loss_function = CausalLMLoss(cp_group=group, vocab_group=getattr(model, VOCAB_GROUP_ATTR, None))
    model.register_forward_pre_hook(_check_inputs, with_kwargs=True)
    setattr(model, CP_MESH_ATTR, cp_mesh)
    # The text decoder sees this rank's chunks, not packed rows: its packing hook stands aside.
    parts.text_model.__dict__[SEQUENCE_SHARDED_ATTR] = True
    return converted


def context_parallel_mesh(model: nn.Module) -> DeviceMesh | None:
    """The cp mesh `install_context_parallel` put on `model`, or None."""
    return getattr(model, CP_MESH_ATTR, None)
