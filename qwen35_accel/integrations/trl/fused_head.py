"""TRL's fused LM head (`add_fused_lm_head`) over a vocab-parallel lm_head: exact, never per slice.

TRL 1.16's trainers (SFT, DPO, GRPO, RLOO, KTO) patch the model's forward so that
`model(..., fused_lm_head=True)` runs the backbone and projects the labelled positions through
`get_output_embeddings()` in tiles, returning per-token log-probabilities (and entropy, top-1,
...) instead of logits. With qwen35_accel's vocab-parallel lm_head that weight is this rank's
V / tp rows, so TRL would normalise over a slice of the vocabulary (log 160 instead of log 320
at init) and leave the hidden states' gradient without the other slices' share: a wrong loss,
silently. The patch point below wraps `add_fused_lm_head` as each TRL trainer module imports
it: TRL's head is installed as usual, and at call time a model whose lm_head is
vocab-parallel computes the same outputs with `linear_token_stats`, which combines the vocab
slices over the tp group. Every other model runs TRL's head unchanged.

Under context parallelism the same patch point gives TRL's whole-row calls (unshifted `labels`,
as DPO and KTO pass them) the per-token fields of whole rows: a forward pre-hook shards the call
with the CP layout, and the forward gathers the fields back (`trl_whole_rows`).

On Qwen3.5-MoE, when the router's loss is asked for and counts more than this rank's tokens (cp >
1, or `moe_balance="global"`), TRL's head runs without router logits and the loss is computed from
the routers' recorded logits with its sums reduced over that group (`_fused_forward_with_router_loss`):
TRL's own computation would take this rank's chunks alone, and under cp fails on the mask dict the
CP pre-hook hands the layers.

`SFTTrainer.compute_loss` divides the summed log-probs by `num_items_in_batch` when the Trainer
counts it, else by this rank's label tokens (`label_mask.sum()`). The Trainer counts it only for
models that take loss kwargs: `Qwen3_5ForConditionalGeneration` declares `accepts_loss_kwargs =
False`, so on the VLM each rank divided by its own chunks' count under CP, and FSDP2 averaged
those per-chunk means: a wrong loss and gradient, silently (`sft_compute_loss` below).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ...model.state import state_of
from ...parallel.losses import IGNORE_INDEX
from ...parallel.tiled_head import linear_token_stats, lm_head_weights

FUSED_HEAD_ATTR = "_qwen35_accel_fused_head"  # marks the forward this module installed
ROUTER_LOSS_ATTR = "_qwen35_accel_router_loss"  # the router's loss of the last fused forward (MoE under a group)
# Text-config attributes by which TRL's head rescales the logits; Qwen3.5 sets none of them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def is_trl_fused_forward(forward: Any) -> bool:
    """Whether `forward` (an instance's bound forward) is TRL's fused-head forward."""
    # TRL decorates it with `functools.wraps(type(model).forward)`: only its code object tells.
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and code.co_filename.replace("\\", "/").endswith(
        "trl/trainer/utils.py"
    )


def check_no_unwrapped_trl_head(model: nn.Module) -> None:
    """NotImplementedError if `model` carries TRL's fused head without qwen35_accel's wrapper
    (added by a TRL module the plugin does not patch): with a vocab-parallel lm_head it would
    normalise over this rank's vocab slice."""
    forward = model.__dict__.get("forward")
    if forward is not None and is_trl_fused_forward(forward) and not getattr(forward, FUSED_HEAD_ATTR, False):
        raise NotImplementedError(
            "this model's forward is TRL's fused LM head (add_fused_lm_head) from a trainer qwen35_accel does not patch; "
            "with QWEN35_ACCEL_VOCAB_PARALLEL_LM_HEAD=1 it would compute log-probabilities over this rank's slice of "
            "the vocabulary (a wrong loss). Use SFTTrainer/DPOTrainer/GRPOTrainer/RLOOTrainer/KTOTrainer, or turn "
            "vocab_parallel_lm_head off."
        )


def _vocab_parallel_fused_forward(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: Any,
    *,
    temperature: float,
    cast_lm_head_to_fp32: bool,
    outputs: tuple[str, ...],
) -> Any:
    """TRL's `_fused_forward(fused_lm_head=True)` contract (see `trl.trainer.utils.add_fused_lm_head`)
    for a vocab-parallel lm_head: every per-token field is the whole vocabulary's."""
    from trl.trainer.utils import FusedCausalLMOutput

    text_config = model.config.get_text_config()
    present = [name for name in _LOGIT_TRANSFORMS if getattr(text_config, name, None) is not None]
    if present:
        raise NotImplementedError(f"TRL's fused head over a vocab-parallel lm_head does not rescale logits ({present})")
    kwargs["use_cache"] = False
    hidden_states = model.base_model(*args, **kwargs).last_hidden_state
    if shift_labels is None:
        hidden_states, labels = hidden_states[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    weight, bias = lm_head_weights(model.get_output_embeddings(), hidden_states)
    labels = labels.to(weight.device)
    mask = labels != IGNORE_INDEX
    hidden_states = hidden_states.to(weight.device)
    autocast = nullcontext()
    if cast_lm_head_to_fp32:
        hidden_states = hidden_states.float()
        autocast = torch.autocast(hidden_states.device.type, enabled=False)
    with autocast:
        stats = linear_token_stats(
            hidden_states[mask],
            weight,
            bias,
            labels[mask],
            group=state_of(model).vocab_group,
            temperature=temperature,
            outputs=tuple(name for name in outputs if name != "log_probs"),
        )
    # `masked_scatter` keeps an all-masked batch connected to the graph (a differentiable zero).
    per_token = {
        name: None if value is None else value.new_zeros(mask.shape).masked_scatter(mask, value)
        for name, value in stats._asdict().items()
    }
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-per_token["log_probs"].sum() / count, label_mask=mask, **per_token)


def trl_add_fused_lm_head(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of TRL's `add_fused_lm_head` as a trainer module imports it: TRL's head, and
    for a model whose lm_head is (or becomes, at preparation) vocab-parallel, the exact
    vocab-parallel head at call time; for a model under (or later put under) context
    parallelism, whole-row calls sharded on entry and their per-token fields gathered back."""

    @functools.wraps(original)
    def wrapper(
        model: nn.Module,
        temperature: float = 1.0,
        cast_lm_head_to_fp32: bool = False,
        outputs: tuple[str, ...] = ("log_probs",),
    ) -> None:
        from ..targets import is_dense_qwen35_module, is_qwen35_module
        from .whole_rows import WHOLE_ROWS_KWARG, add_whole_rows_hook, gather_whole_rows

        original(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
        if not is_qwen35_module(model):
            return
        moe = not is_dense_qwen35_module(model)
        trl_forward = model.forward
        if not moe:  # MoE: whole-row calls (DPO, KTO) under cp stay refused by the CP pre-hook (shift_labels)
            add_whole_rows_hook(model)

        @functools.wraps(type(model).forward)
        def forward(
            self: nn.Module,
            *args: Any,
            fused_lm_head: bool = False,
            labels: torch.Tensor | None = None,
            shift_labels: torch.Tensor | None = None,
            num_items_in_batch: Any = None,
            **kwargs: Any,
        ) -> Any:
            whole_rows = kwargs.pop(WHOLE_ROWS_KWARG, None)  # set by the pre-hook: this rank's chunks of whole rows
            group = _router_balance_group(self) if moe and fused_lm_head and _router_loss_requested(self, kwargs) else None
            if group is not None:
                output = _fused_forward_with_router_loss(
                    trl_forward, self, group, args, kwargs,
                    labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                )
            elif fused_lm_head and state_of(self).vocab_group is not None:
                output = _vocab_parallel_fused_forward(
                    self, args, kwargs, labels, shift_labels, num_items_in_batch,
                    temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=tuple(outputs),
                )
            else:
                output = trl_forward(
                    *args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                    num_items_in_batch=num_items_in_batch, **kwargs,
                )
            return output if whole_rows is None else gather_whole_rows(output, whole_rows, num_items_in_batch)

        setattr(forward, FUSED_HEAD_ATTR, True)
        model.forward = types.MethodType(forward, model)

    return wrapper


def _router_loss_requested(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """TRL's fused forward asks the backbone for the router's logits (and adds the load-balancing
    loss) when the call or the text config says so."""
    requested = kwargs.get("output_router_logits")
    return bool(getattr(model.config.get_text_config(), "output_router_logits", False) if requested is None else requested)


def _router_balance_group(model: nn.Module) -> Any:
    """The group a prepared Qwen3.5-MoE's router loss counts tokens over, beyond this rank's: dp_shard
    × cp with `moe_balance="global"`, else the cp group under cp > 1; None: this rank's tokens (TRL's
    own computation is then exact)."""
    from ..targets import prepared_qwen35

    qwen = prepared_qwen35(model)
    global_group = state_of(qwen).balance_group
    return global_group if global_group is not None else _cp_group_of(model)


def _fused_forward_with_router_loss(
    trl_forward: Callable[..., Any], model: nn.Module, group: Any, args: tuple[Any, ...], kwargs: dict[str, Any], **fused: Any
) -> Any:
    """TRL's fused forward with the router's load-balancing loss over `group`'s tokens.

    TRL would take it from this rank's tokens with Transformers' `load_balancing_loss_func`, which
    under cp cannot even read the mask the CP pre-hook hands the layers (a dict). Here TRL's forward
    runs without router logits, the routers' logits of this forward are recorded as they are made
    (the layers' order, as Transformers collects them), and `parallel.expert_parallel.router.router_balance_loss`
    reduces the loss's three sums over `group`: the value is one process's on those tokens, the
    gradient this rank's share (scaled for FSDP2's average, as the cross entropy). It is added to
    `loss` and returned as `aux_loss`, as TRL does."""
    from ...model.detect import ROUTER_CLASSES
    from ...parallel.expert_parallel.router import router_balance_loss

    recorded: list[torch.Tensor] = []
    handles = [module.register_forward_hook(lambda _m, _i, out: recorded.append(out[0]))
               for module in model.modules() if isinstance(module, ROUTER_CLASSES)]  # every MoE family's routers
    try:  # an activation checkpoint's recompute runs in backward, after the hooks are gone
        output = trl_forward(*args, fused_lm_head=True, **fused, **{**kwargs, "output_router_logits": False})
    finally:
        for handle in handles:
            handle.remove()
    text = model.config.get_text_config()
    mask = kwargs.get("attention_mask")
    padding = mask.get("linear_attention") if isinstance(mask, dict) else mask  # the CP pre-hook's dict
    aux = router_balance_loss(tuple(recorded), text.num_experts, text.num_experts_per_tok, padding, group)
    output.aux_loss = aux
    model.__dict__[ROUTER_LOSS_ATTR] = aux  # for `sft_compute_loss`, which sees TRL's sum of the two losses only
    if output.loss is not None:
        output.loss = output.loss + getattr(text, "router_aux_loss_coef", 0.0) * aux.to(output.loss.dtype)
    return output


def _cp_group_of(model: nn.Module) -> Any:
    """The cp process group of the prepared dense Qwen3.5 model inside `model` (under CP now), else None."""
    from ...parallel.context_parallel.model import context_parallel_mesh
    from ..targets import prepared_qwen35

    qwen = prepared_qwen35(model)
    mesh = context_parallel_mesh(qwen) if qwen is not None else None
    return None if mesh is None or mesh.size() == 1 else mesh.get_group()


def sft_compute_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of TRL's `SFTTrainer.compute_loss`: for a prepared Qwen3.5 model under cp > 1 in
    training, with no `num_items_in_batch` (the VLM class: the Trainer counts none, see the module
    docstring), this rank's loss becomes `cp · local_sum / group_count` (a MoE model's router loss,
    already the group's, added unscaled).

    TRL returns `local_sum / max(local_count, 1)` over this rank's chunks (`shift_labels`); one
    process (or one data-parallel replica) returns the mean over the whole rows, `group_sum /
    group_count`. Rescaled by `local_count · cp / group_count` (one scalar all-reduce over the cp
    group), the mean over the cp ranks of the logged losses is the replica's mean, and FSDP2's
    average over `dp_shard_cp` of the gradients is the replica's gradient (dp replicas averaged
    as stock DDP averages their means). Every other call is TRL's own."""

    @functools.wraps(original)
    def wrapper(self: Any, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                num_items_in_batch: Any = None) -> Any:
        result = original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        # A MoE model's router loss of this call (`_fused_forward_with_router_loss`), taken off the model always.
        router = next((m.__dict__.pop(ROUTER_LOSS_ATTR) for m in model.modules() if ROUTER_LOSS_ATTR in m.__dict__), None)
        group = _cp_group_of(model) if num_items_in_batch is None and model.training else None
        shift_labels = inputs.get("shift_labels") if group is not None else None
        if shift_labels is None:
            return result
        if self.compute_loss_func is not None or self.label_smoother is not None:
            raise NotImplementedError(
                "TRL's SFTTrainer under context parallelism with a compute_loss_func or label smoothing on a model that "
                "takes no loss kwargs (Qwen3_5ForConditionalGeneration): the loss would be a mean over this rank's "
                "chunks only. Train without them, or with cp_size 1."
            )
        loss, outputs = result if return_outputs else (result, None)
        local = (shift_labels != IGNORE_INDEX).sum().to(loss.device)
        total = local.clone()
        torch.distributed.all_reduce(total, group=group)
        # The router loss TRL added to this rank's mean is the group's already: only the cross entropy is rescaled.
        routed = self.router_aux_loss_coef * router.to(loss.dtype) if router is not None and self.aux_loss_enabled else 0.0
        loss = (loss - routed) * (local * torch.distributed.get_world_size(group) / total.clamp(min=1)).to(loss.dtype) + routed
        return (loss, outputs) if return_outputs else loss

    return wrapper
