"""The causal-LM loss of a parallelized model (`model.loss_function`), over a cp group
(the sequence sharded), a vocab-parallel lm_head's tp group (the logits sliced by vocab),
or both. Context and tensor parallelism both install it and it imports neither (only
`parallel/collectives.py`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import reduce_from_group

IGNORE_INDEX = -100
# Set on the model by a vocab-parallel lm_head: its tp group (the logits hold a vocab slice).


CP_NEEDS_SHIFT_LABELS = (
    "under context parallelism the loss needs `shift_labels` (labels shifted left over the whole sequence, then "
    "sharded); qwen35_accel.context_parallel.shard_batch and the Trainer integration provide them."
)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token cross entropy [N] fp32 (0 where `target == ignore_index`) from this rank's
    vocab slice of the logits, without gathering them.

    `logits`: [N, V / tp], rank r holding vocab entries r·V/tp …; `target`: [N] global
    token ids. The max, the sum of exponentials and the target's logit are combined over
    the tp group (three [N] all-reduces); the gradient reaches each rank's slice only.
    Collective over `group`: every rank passes the same `target`.
    """
    logits = logits.float()
    local_vocab = logits.shape[-1]
    start = dist.get_rank(group) * local_vocab
    with torch.no_grad():  # a constant shift: softmax and its gradient do not depend on it
        shift = logits.max(dim=-1).values
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - shift.unsqueeze(-1)
    sum_exp = reduce_from_group(shifted.exp().sum(dim=-1), group)
    valid = target != ignore_index
    local_target = target - start
    mine = valid & (local_target >= 0) & (local_target < local_vocab)
    # Advanced indexing keeps only the indices for backward (gather would keep `shifted`).
    rows = torch.arange(shifted.shape[0], device=shifted.device)
    picked = shifted[rows, local_target.clamp(0, local_vocab - 1)]
    target_logit = reduce_from_group(picked * mine, group)
    return (sum_exp.log() - target_logit) * valid


def reduce_token_loss(
    local_sum: torch.Tensor,
    count: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None,
    cp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The causal-LM loss from this rank's summed token losses `local_sum` (fp32 scalar) over
    `count` labelled tokens, as `CausalLMLoss` documents (num_items_in_batch / no CP / CP)."""
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(local_sum.device)
        return local_sum / num_items_in_batch
    if cp_group is None:
        return local_sum / count
    cp = dist.get_world_size(cp_group)
    totals = torch.stack([local_sum.detach(), count.to(local_sum.dtype)])
    dist.all_reduce(totals, group=cp_group)
    total_sum, total_count = totals.unbind(0)
    seed = local_sum * (cp / total_count)
    # Value: the group's mean loss; gradient: this rank's share, scaled for FSDP's average.
    return seed + (total_sum / total_count - seed).detach()


class CausalLMLoss:
    """Transformers' causal-LM loss (`model.loss_function`'s signature) for a sequence
    sharded over `cp_group` and/or logits sliced by vocab over `vocab_group` (at least one).

    `logits`: [..., V] (or [..., V / tp] with `vocab_group`), any float dtype, computed in
    fp32; `shift_labels`: [...] next-token ids, required under CP (the next token of a
    chunk's last token lives on another rank); without CP, `labels` are shifted here.
    - `num_items_in_batch` given (the Trainer): local sum / `num_items_in_batch`, as
      Transformers' loss; the Trainer's scaling and FSDP's averaging make the rest.
    - otherwise, no CP: local sum / local count of labelled tokens.
    - otherwise, CP: the value is the mean over the whole cp group's tokens on every rank,
      and the gradient is cp × (local sum / global count), so that FSDP's average over
      `dp_shard_cp` gives exactly the single-process gradient (one [2] all-reduce).
    """

    def __init__(self, *, cp_group: dist.ProcessGroup | None = None, vocab_group: dist.ProcessGroup | None = None) -> None:
        if cp_group is None and vocab_group is None:
            raise ValueError("CausalLMLoss needs a cp group, a vocab group or both (otherwise use Transformers' loss)")
        self.cp_group = cp_group
        self.vocab_group = vocab_group

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
            if self.cp_group is not None:
                raise ValueError(CP_NEEDS_SHIFT_LABELS)
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        logits = logits.float()
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        if self.vocab_group is not None:
            local_sum = vocab_parallel_cross_entropy(
                logits.reshape(-1, logits.shape[-1]), shift_labels, self.vocab_group, ignore_index
            ).sum()
        else:
            local_sum = F.cross_entropy(
                logits.reshape(-1, vocab_size), shift_labels, ignore_index=ignore_index, reduction="sum"
            )
        return reduce_token_loss(local_sum, (shift_labels != ignore_index).sum(), num_items_in_batch, self.cp_group)


class VocabParallelCausalLMLoss(CausalLMLoss):
    """`CausalLMLoss` over a vocab-parallel lm_head's tp `group` only (no CP)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(vocab_group=group)
