"""A training loss that never holds `[tokens, vocab]`: the lm_head and the cross entropy in blocks.

`install_tiled_loss(model)` gives a `Qwen3_5ForCausalLM`, a `Qwen3_5ForConditionalGeneration`
(the VLM: the same loss after its vision tower and mRoPE) or a `Qwen3_5MoeForCausalLM` (the
router's load-balancing loss added as Transformers adds it) a forward that, when autograd is
recording and `labels` are given (a training step), runs the backbone and computes the loss
with `linear_cross_entropy_sum` over the labelled positions only, block by block, and returns
`logits=None`: nothing of size tokens × vocab is made whole or kept for backward
(Transformers' path keeps the logits and an fp32 copy, ~1.45 MiB per token at vocab
248,320). Its mode: "recompute" (the default) keeps the labelled hidden states and one fp32
number per token and recomputes each block's logits in backward; "hold" computes the
gradients in forward (the same GEMMs) and holds them, the lm_head weight's size among them.
The loss is
Transformers' (`num_items_in_batch`, `shift_labels`, -100 ignored), over the model's cp
group and vocab-parallel lm_head when `PARALLELIZER.apply` installed them (`CausalLMLoss`'s
groups). Every other call — no labels, no grad (evaluation, prediction, generation),
`logits_to_keep`, a PEFT-wrapped lm_head — runs Transformers' forward unchanged, logits
included.

The model's class becomes a subclass of its own class with the same name (so checkpoints
name the Transformers class), overriding `forward` only; instance-level forwards (TRL's fused
head) keep precedence.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import MultimodalCausalLMOutputWithPast
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf_qwen4

from ..model.state import own_state, state_of
from .losses import CP_NEEDS_SHIFT_LABELS, IGNORE_INDEX, CausalLMLoss, reduce_token_loss
from .expert_parallel.router import router_loss_coefficient
from .options import tiled_loss_choice  # noqa: F401  (re-exported: declared with its knob)
from .tiled_head import DEFAULT_LOSS_MODE, LOSS_MODES, linear_cross_entropy_sum, lm_head_weights

_TILED_CLASSES: dict[type, type] = {}
# The classes that take the tiled loss, with the output class of their forward.
_OUTPUT_CLASSES: dict[type, type] = {
    hf.Qwen3_5ForCausalLM: hf.CausalLMOutputWithPast,
    hf.Qwen3_5ForConditionalGeneration: MultimodalCausalLMOutputWithPast,
    hf_moe.Qwen3_5MoeForCausalLM: hf_moe.MoeCausalLMOutputWithPast,
    hf_moe.Qwen3_5MoeForConditionalGeneration: hf_moe.Qwen3_5MoeCausalLMOutputWithPast,
    hf_next.Qwen3NextForCausalLM: hf_next.MoeCausalLMOutputWithPast,  # its forward is Qwen3.5-MoE's, op for op
    hf_qwen4.Qwen4ExpForCausalLM: hf_qwen4.MoeCausalLMOutputWithPast,  # so is Qwen4-Exp's
}
_VLM_CLASSES = (hf.Qwen3_5ForConditionalGeneration, hf_moe.Qwen3_5MoeForConditionalGeneration)
_MOE_CLASSES = (hf_moe.Qwen3_5MoeForCausalLM, hf_moe.Qwen3_5MoeForConditionalGeneration, hf_next.Qwen3NextForCausalLM,
                hf_qwen4.Qwen4ExpForCausalLM)


def uses_tiled_loss(model: nn.Module) -> bool:
    """Whether training forwards of `model` compute the tiled loss."""
    return state_of(model).tiled_loss is not None


def tiled_loss_mode(model: nn.Module) -> str:
    """The tiled loss's mode on `model`: "recompute", "hold", or "off" (Transformers' loss)."""
    return state_of(model).tiled_loss or "off"


def _tiled_loss_applies(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if not uses_tiled_loss(model) or kwargs.get("labels") is None or not torch.is_grad_enabled() or len(args) > 1:
        return False
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    if not isinstance(logits_to_keep, int) or logits_to_keep != 0:
        return False
    lm_head = model.get_output_embeddings()
    # A PEFT-wrapped lm_head (LoRA on it) computes more than `weight`: Transformers' path.
    return isinstance(lm_head, nn.Linear) and not hasattr(lm_head, "base_layer")


def tiled_causal_lm_loss(
    model: nn.Module, hidden_states: torch.Tensor, labels: torch.Tensor, **loss_kwargs: Any
) -> torch.Tensor:
    """The causal-LM loss of `hidden_states` [batch, seq, hidden] through `model`'s lm_head,
    as `model.loss_function(logits, labels, ...)` would compute it from the whole logits.

    `loss_kwargs`: `num_items_in_batch`, `shift_labels` (required under CP), `ignore_index`.
    """
    shift_labels = loss_kwargs.get("shift_labels")
    ignore_index = loss_kwargs.get("ignore_index", IGNORE_INDEX)
    loss_function = model.loss_function
    cp_group = loss_function.cp_group if isinstance(loss_function, CausalLMLoss) else None
    if shift_labels is None:
        if cp_group is not None:
            raise ValueError(CP_NEEDS_SHIFT_LABELS)
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    weight, bias = lm_head_weights(model.get_output_embeddings(), hidden_states)
    targets = shift_labels.reshape(-1).to(hidden_states.device)
    labelled = targets != ignore_index
    local_sum = linear_cross_entropy_sum(
        hidden_states.reshape(-1, hidden_states.shape[-1])[labelled],
        weight,
        bias,
        targets[labelled],
        group=state_of(model).vocab_group,
        tile=state_of(model).tile,
        mode=tiled_loss_mode(model),
    )
    return reduce_token_loss(local_sum, labelled.sum(), loss_kwargs.get("num_items_in_batch"), cp_group)


def _router_loss(model: nn.Module, router_logits: tuple[torch.Tensor, ...], attention_mask: Any) -> torch.Tensor:
    """Transformers' load-balancing loss; under CP (the CP pre-hook hands the layers a dict of
    masks, the padding mask under "linear_attention") its sums reduced over the cp group, with
    `moe_balance="global"` over dp_shard × cp (`parallel.expert_parallel.router`)."""
    loss_function = model.loss_function
    cp_group = loss_function.cp_group if isinstance(loss_function, CausalLMLoss) else None
    group = state_of(model).balance_group or cp_group  # moe_balance="global": dp_shard × cp
    text = model.config.get_text_config()
    if group is None:
        return hf_moe.load_balancing_loss_func(router_logits, text.num_experts, text.num_experts_per_tok, attention_mask)
    from .expert_parallel.router import router_balance_loss

    padding = attention_mask.get("linear_attention") if isinstance(attention_mask, dict) else attention_mask
    return router_balance_loss(router_logits, text.num_experts, text.num_experts_per_tok, padding, group)


def _tiled_class(cls: type) -> type:
    """`cls` with the tiled-loss forward (one subclass per class, named as `cls`)."""
    if cls in _TILED_CLASSES:
        return _TILED_CLASSES[cls]
    base_forward = cls.forward

    @functools.wraps(base_forward)  # the same signature: the Trainer inspects it (loss kwargs, columns)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not _tiled_loss_applies(self, args, kwargs):
            return base_forward(self, *args, **kwargs)
        if args:
            kwargs["input_ids"] = args[0]
        labels = kwargs.pop("labels")
        kwargs.pop("logits_to_keep", None)
        return_dict = kwargs.pop("return_dict", None)
        moe = isinstance(self, _MOE_CLASSES)
        if moe:
            router_logits = kwargs.pop("output_router_logits", None)
            router_logits = self.config.get_text_config().output_router_logits if router_logits is None else router_logits
            outputs = self.model(output_router_logits=router_logits, **kwargs)
        else:
            # As Transformers' forward: every other kwarg reaches the backbone and the loss alike.
            outputs = self.model(**kwargs)
        loss = tiled_causal_lm_loss(self, outputs.last_hidden_state, labels, **kwargs)
        fields = {"cache": outputs.cache, "hidden_states": outputs.hidden_states, "attentions": outputs.attentions}
        if isinstance(self, _VLM_CLASSES):
            fields.update(image_outputs=outputs.image_outputs, video_outputs=outputs.video_outputs)
        if moe:  # the router's load-balancing loss, where and as Transformers' forward adds it
            aux_loss = None
            if router_logits:
                aux_loss = _router_loss(self, outputs.router_logits, kwargs.get("attention_mask"))
                loss = loss + router_loss_coefficient(self) * aux_loss.to(loss.device)
            fields.update(aux_loss=aux_loss, router_logits=outputs.router_logits)
        output_class = next(out for model_class, out in _OUTPUT_CLASSES.items() if isinstance(self, model_class))
        result = output_class(loss=loss, logits=None, **fields)
        return result.to_tuple() if return_dict is False else result

    tiled = type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__, "__qualname__": cls.__qualname__})
    _TILED_CLASSES[cls] = tiled
    return tiled


def install_tiled_loss(model: nn.Module, *, tile: int | None = None, mode: str = DEFAULT_LOSS_MODE) -> bool:
    """Give `model` (a `Qwen3_5ForCausalLM`, `Qwen3_5ForConditionalGeneration`, either MoE class or
    `Qwen3NextForCausalLM`, unsharded)
    the tiled training loss in `mode` (`LOSS_MODES`: "recompute" or "hold", see
    `linear_cross_entropy_sum`), `tile` tokens per block (default: `tiled_blocks.block_shape`'s);
    returns False, changing nothing, for other classes. Idempotent."""
    if mode not in LOSS_MODES:
        raise ValueError(f"install_tiled_loss: mode {mode!r} is not one of {list(LOSS_MODES)}")
    if not isinstance(model, tuple(_OUTPUT_CLASSES)):
        return False
    if model.__class__ not in _TILED_CLASSES.values():
        model.__class__ = _tiled_class(model.__class__)
    state = own_state(model)
    state.tiled_loss, state.tile = mode, tile
    return True
