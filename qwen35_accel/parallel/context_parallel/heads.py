"""Classification heads on a Qwen3.5 backbone under context parallelism.

A sequence classifier (reward model: `Qwen3_5TextForSequenceClassification`,
`Qwen3_5ForSequenceClassification`) scores each row from the hidden state of its last real
token: the rightmost token that is not `pad_token_id` (Transformers' rule, which reads
`input_ids` and not the attention mask). Under context parallelism that token lives on one rank.
`ContextParallelSequenceClassifier` finds its global position (an all-reduce of each rank's
rightmost real position, max), takes its hidden state from the rank that holds it (an all-reduce
of `[batch, hidden]`, zeros elsewhere), so every rank scores the same pooled hidden state and
computes the same loss. The gradient reaches the owner's token scaled by cp, as the causal LM's
loss is (`losses.reduce_token_loss`): FSDP2's average over dp_shard × cp then gives one process's.

A token classifier (`Qwen3_5ForTokenClassification`) labels every token where it stands: its labels
are sharded with the tokens, unshifted (the Trainer's CP preparation would shift them as a causal LM's:
the plugin hands them to it as `shift_labels`, already in place), and its cross entropy is reduced as
the causal LM's (`losses.reduce_token_loss`): over the Trainer's `num_items_in_batch` when given (the
Trainer's scaling and FSDP2's average make the rest), else the cp group's mean over labelled tokens on
every rank, each rank's gradient its share scaled for FSDP2's average. Its `logits` are this rank's
chunks'.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification
from transformers.modeling_outputs import SequenceClassifierOutputWithPast, TokenClassifierOutput

from ..losses import IGNORE_INDEX, reduce_token_loss
from .chunks import local_positions

HEAD_GROUP_ATTR = "_cp_group"  # the name the CP layers use: `context_parallel_paused` pauses the head too
_CP_HEAD_CLASSES: dict[type, type] = {}


def pooled_last_real_token(
    hidden_states: torch.Tensor, input_ids: torch.Tensor | None, pad_token_id: int | None, group: dist.ProcessGroup
) -> torch.Tensor:
    """The hidden state `[batch, hidden]` of each row's last real token, from this rank's chunks
    `hidden_states` `[batch, local seq, hidden]` (the CP layout, `layout.local_positions`) and
    `input_ids` `[batch, local seq]` (or None: the row's last position, as Transformers takes it for
    `inputs_embeds`). The value is the same on every rank of `group`; the gradient flows to the
    owner's token times the group size. Two all-reduces over `group`."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, local = hidden_states.shape[:2]
    positions = local_positions(local * cp, cp, rank, hidden_states.device)
    if input_ids is None or pad_token_id is None:
        last = torch.full((rows,), local * cp - 1, device=hidden_states.device, dtype=torch.long)
    else:
        real = (input_ids != pad_token_id).to(hidden_states.device)
        last = (positions[None, :] * real).amax(dim=1)  # 0 for a row without real tokens, as Transformers' argmax
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=group)
    owned = (positions[None, :] == last[:, None]).to(hidden_states.dtype)  # [batch, local seq]: one 1 per row, on one rank
    mine = (owned[..., None] * hidden_states).sum(dim=1)  # [batch, hidden]: zeros where another rank holds the token
    whole = mine.detach().clone()
    dist.all_reduce(whole, group=group)
    seed = mine * cp
    return seed + (whole - seed).detach()


def _sequence_classifier_forward(self: nn.Module, input_ids: Any, labels: Any, group: Any, kwargs: dict[str, Any]) -> Any:
    """`GenericForSequenceClassification.forward` on this rank's chunks: the pooled hidden state of
    the whole row (`pooled_last_real_token`), then the score and Transformers' loss on it."""
    outputs = getattr(self, self.base_model_prefix)(input_ids, use_cache=False, **kwargs)
    pad_token_id = self.config.get_text_config().pad_token_id
    pooled = pooled_last_real_token(outputs.last_hidden_state, input_ids, pad_token_id, group)
    pooled_logits = self.score(pooled)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=pooled_logits, labels=labels, pooled_logits=pooled_logits, config=self.config)
    return SequenceClassifierOutputWithPast(
        loss=loss, logits=pooled_logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
    )


def _token_classifier_forward(
    self: nn.Module, input_ids: Any, labels: Any, group: Any, kwargs: dict[str, Any], num_items_in_batch: Any = None
) -> Any:
    """`GenericForTokenClassification.forward` on this rank's chunks; `labels` `[batch, local seq]`
    (sharded with the tokens, unshifted, -100 ignored): the cross entropy over the Trainer's count
    `num_items_in_batch`, or over the cp group's labelled tokens."""
    outputs = getattr(self, self.base_model_prefix)(input_ids, use_cache=False, **kwargs)
    logits = self.score(self.dropout(outputs.last_hidden_state))
    loss = None
    if labels is not None:
        targets = labels.reshape(-1).to(logits.device)
        # ignore_index, not a boolean-mask index: no host sync on CUDA.
        local_sum = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        loss = reduce_token_loss(local_sum, (targets != IGNORE_INDEX).sum(), num_items_in_batch, group)
    return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _context_parallel_class(cls: type) -> type:
    """`cls` with the CP forward (one subclass per class, named as `cls`, so checkpoints and the
    Trainer's signature inspection see Transformers' class)."""
    if cls in _CP_HEAD_CLASSES:
        return _CP_HEAD_CLASSES[cls]
    base_forward = cls.forward
    local_forward = _token_classifier_forward if issubclass(cls, GenericForTokenClassification) else _sequence_classifier_forward

    @functools.wraps(base_forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        group = self.__dict__.get(HEAD_GROUP_ATTR)
        if group is None:  # CP paused (whole sequences on every rank): Transformers' forward
            return base_forward(self, *args, **kwargs)
        if args:
            kwargs["input_ids"] = args[0]
        input_ids, labels = kwargs.pop("input_ids", None), kwargs.pop("labels", None)
        count = kwargs.pop("num_items_in_batch", None)
        for key in ("cache", "use_cache", "shift_labels"):
            kwargs.pop(key, None)
        if local_forward is _token_classifier_forward:
            return local_forward(self, input_ids, labels, group, kwargs, num_items_in_batch=count)
        return local_forward(self, input_ids, labels, group, kwargs)

    _CP_HEAD_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__,
                                                        "__qualname__": cls.__qualname__})
    return _CP_HEAD_CLASSES[cls]


def install_context_parallel_head(model: nn.Module, group: dist.ProcessGroup) -> bool:
    """Give a classification head on a Qwen3.5 backbone the CP forward over `group`; False (nothing
    changed) for any other model."""
    if not isinstance(model, (GenericForSequenceClassification, GenericForTokenClassification)):
        return False
    if type(model) not in _CP_HEAD_CLASSES.values():
        model.__class__ = _context_parallel_class(type(model))
    model.__dict__[HEAD_GROUP_ATTR] = group
    return True
