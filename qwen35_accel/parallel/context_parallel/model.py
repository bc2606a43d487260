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
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ...model.detect import qwen35_parts
from ...model.fp32_gate import Fp32GateGatedDeltaNet
from ...model.packing import SEQUENCE_SHARDED_ATTR
from ..tensor_parallel import VOCAB_GROUP_ATTR, vocab_parallel_cross_entropy
from .attention import SUPPORTED_ATTENTION, ContextParallelAttention
from .gated_delta_net import ContextParallelGatedDeltaNet

IGNORE_INDEX = -100
CP_MESH_ATTR = "_qwen35_cp_mesh"


class ContextParallelCausalLMLoss:
    """Causal-LM loss of a sequence sharded across a cp group (`model.loss_function`).

    Needs `shift_labels` (this rank's next-token labels: the next token of a chunk's last
    token lives elsewhere). Two regimes:
    - `num_items_in_batch` given (the Trainer): local sum / `num_items_in_batch`, as
      Transformers' loss; the Trainer's scaling and FSDP's averaging make the rest.
    - otherwise: the value is the mean over the whole cp group's tokens on every rank,
      and the gradient is cp × (local sum / global count), so that FSDP's average over
      `dp_shard_cp` gives exactly the single-process gradient.
    """

    def __init__(self, group: dist.ProcessGroup, vocab_group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.vocab_group = vocab_group  # a vocab-parallel lm_head's tp group: logits hold a vocab slice

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            raise ValueError(
                "under context parallelism the loss needs `shift_labels` (labels shifted left over the whole sequence, "
                "then sharded); qwen35_accel.context_parallel.shard_batch and the Trainer integration provide them."
            )
        logits = logits.float()
        shift_labels = shift_labels.to(logits.device)
        if self.vocab_group is not None:
            local_sum = vocab_parallel_cross_entropy(
                logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), self.vocab_group, ignore_index
            ).sum()
        else:
            local_sum = F.cross_entropy(
                logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
            )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(local_sum.device)
            return local_sum / num_items_in_batch
        cp = dist.get_world_size(self.group)
        totals = torch.stack([local_sum.detach(), (shift_labels != ignore_index).sum().to(local_sum.dtype)])
        dist.all_reduce(totals, group=self.group)
        total_sum, total_count = totals.unbind(0)
        seed = local_sum * (cp / total_count)
        # Value: the group's mean loss; gradient: this rank's share, scaled for FSDP's average.
        return seed + (total_sum / total_count - seed).detach()


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
    model.loss_function = ContextParallelCausalLMLoss(group, getattr(model, VOCAB_GROUP_ATTR, None))
    model.register_forward_pre_hook(_check_inputs, with_kwargs=True)
    setattr(model, CP_MESH_ATTR, cp_mesh)
    # The text decoder sees this rank's chunks, not packed rows: its packing hook stands aside.
    parts.text_model.__dict__[SEQUENCE_SHARDED_ATTR] = True
    return converted


def context_parallel_mesh(model: nn.Module) -> DeviceMesh | None:
    """The cp mesh `install_context_parallel` put on `model`, or None."""
    return getattr(model, CP_MESH_ATTR, None)
