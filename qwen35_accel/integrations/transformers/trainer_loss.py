"""What the plain Trainer's loss scaling must not multiply: the MoE router's term, a classifier's loss.

Stock `Trainer.compute_loss` (Transformers 5.24, 5.25) multiplies the model's whole loss by
`num_processes // tp` when the model takes loss kwargs and `num_items_in_batch` is counted
(`average_tokens_across_devices`, the default), to undo the gradient average over the data-parallel
ranks of a cross entropy the model divided by the global token count; it then leaves gradient
accumulation to the loss (no division by the micro-batches). Two losses on Qwen3.5 models are not
of that kind, and the plugin's `Trainer.compute_loss` point (`trainer_compute_loss`) counts them once:

- **The MoE router's load-balancing term** (issue 57). The objective (docs/moe.md, "The router's
  loss in a step"): `CE over the global batch's labelled tokens + router_aux_loss_coef × R`, R the
  mean of the step's router losses — one per data-parallel replica and micro-batch by default (each
  replica's rows, whole rows under cp), one per micro-batch of the global batch with
  `QWEN35_ACCEL_MOE_BALANCE=global`. Stock's factor rides on the router term (Transformers issue
  48690): `num_processes` times the coefficient, and once more per micro-batch. The point takes both
  factors off the router term; the cross entropy keeps the Trainer's scaling.
- **A classification head's loss** (issue 58: reward models, classifiers). Transformers' generic
  heads compute a mean over this rank's rows (tokens) and never read `num_items_in_batch`, yet the
  Trainer counts it for them (their forward takes `**kwargs`) and multiplies: the logged loss and the
  gradient `num_processes × accumulation` times one process's. For a sequence classifier the point
  runs such a call without the count (no multiplication) and divides by the micro-batches: the mean
  over replicas and micro-batches, one process's when they hold as many rows. A token classifier's
  loss takes the count as Transformers' `ForTokenClassification` loss was meant to (the labelled
  tokens' summed cross entropy over the step's global count, as the causal LM's; under cp the CP
  forward divides by it itself), and keeps the Trainer's scaling: one process's loss however the
  labelled tokens fall on the ranks and micro-batches.

TRL's trainers do not go through here (they override `compute_loss` and add the router term each
their own way, unmultiplied: docs/moe.md); a Trainer subclass that calls `super().compute_loss` does.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


# Trainers whose stock scaling was checked (once each: the check reads a scalar back, a host sync).
_CHECKED: weakref.WeakSet[Any] = weakref.WeakSet()


def _qwen35_inside(model: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(the Qwen3.5 model inside what the Trainer calls, its family) — DDP's `.module`, torch.compile's
    and PEFT's wrappers looked through (FSDP2 keeps the module itself) — or (None, None)."""
    from ...model.detect import qwen35_family, unwrap_qwen35

    inner = getattr(model, "module", model)
    family = qwen35_family(inner) if isinstance(inner, nn.Module) else None
    return (unwrap_qwen35(inner), family) if family is not None else (None, None)


def stock_loss_scale(trainer: Any, num_items_in_batch: Any) -> int:
    """The factor stock `Trainer.compute_loss` multiplies the model's loss by (Transformers 5.24
    and 5.25): `num_processes // tp` with `average_tokens_across_devices` and `num_items_in_batch`
    (`n_gpu` under DataParallel), else 1."""
    if not (
        trainer.args.average_tokens_across_devices
        and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func)
        and num_items_in_batch is not None
    ):
        return 1
    return trainer.accelerator.num_processes // trainer.get_tp_size() if trainer.args.n_gpu <= 1 else trainer.args.n_gpu


def accumulation_divisor(trainer: Any, num_items_in_batch: Any, training: bool) -> int:
    """By how much the router term of one micro-batch must be divided in the loss `compute_loss`
    returns: in training, the accumulation steps when `training_step` will not divide the loss itself
    (the loss counts as already scaled for accumulation, as the Trainer decides it), else 1;
    evaluation (`prediction_step` passes a count too) accumulates nothing: 1."""
    if not training:
        return 1
    scaled = trainer.loss_is_scaled_for_ga
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or trainer.compute_loss_func is not None
    return trainer.current_gradient_accumulation_steps if scaled else 1


def _models_own_loss(trainer: Any, inputs: dict[str, Any]) -> bool:
    """Whether the model's own loss (labels passed to it, no custom loss) is what compute_loss returns."""
    if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
        return False  # the labels are taken out: the model's loss (router term included) is not used
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled:
        return False  # DeepSpeed's sequence-parallel loss: its own path
    return inputs.get("labels") is not None


def _token_classifier_loss(trainer: Any, original: Callable[..., Any], model: nn.Module, inner: nn.Module,
                           inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any,
                           kwargs: dict[str, Any]) -> Any:
    """A token classifier's loss with the Trainer's count (see the module docstring): Transformers'
    `ForTokenClassification` loss given `num_items_in_batch` (summed over the labelled tokens, divided
    by the count) times the Trainer's scale. Under cp the CP forward reads the count itself."""
    from ...parallel.context_parallel.model import context_parallel_mesh

    if context_parallel_mesh(inner) is not None:
        return original(trainer, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch,
                        **kwargs)
    _, outputs = original(trainer, model, inputs, return_outputs=True, num_items_in_batch=None, **kwargs)
    loss = inner.loss_function(outputs["logits"], inputs["labels"], inner.config, num_items_in_batch=num_items_in_batch)
    loss = loss * stock_loss_scale(trainer, num_items_in_batch)
    return (loss, outputs) if return_outputs else loss


def trainer_compute_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of `Trainer.compute_loss`: on a Qwen3.5-MoE model whose forward adds the router's
    loss (`aux_loss` in its output), the returned loss carries `coef × aux / accumulation` instead of
    stock's `coef × aux × num_processes // tp` (see the module docstring); the cross entropy keeps the
    Trainer's scaling. On a Qwen3.5 classification head, the model's loss divided by the accumulation
    steps, never multiplied. Every other model and call is stock.

    The stock scaling is checked at each trainer's first such call (a host sync, once): the model's
    loss, recorded as it leaves the forward, times `stock_loss_scale` must equal what the original
    returns bitwise, else RuntimeError (a Transformers release that changed the scaling, or fixed
    issue 48690, would be corrected twice)."""

    @functools.wraps(original)
    def wrapper(self: Any, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        from transformers.modeling_layers import GenericForTokenClassification

        from ...model.detect import HEAD_CLASSES

        own_loss = _models_own_loss(self, inputs)
        inner, family = _qwen35_inside(model) if own_loss else (None, None)
        if inner is not None and num_items_in_batch is not None and isinstance(inner, GenericForTokenClassification):
            return _token_classifier_loss(self, original, model, inner, inputs, return_outputs, num_items_in_batch, kwargs)
        if inner is not None and num_items_in_batch is not None and isinstance(inner, HEAD_CLASSES):
            # A classifier's loss is a mean over this rank's rows: no count, no multiplication; the
            # micro-batches averaged (the Trainer will not divide, since a count was made).
            divisor = accumulation_divisor(self, num_items_in_batch, model.training)
            result = original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=None, **kwargs)
            loss, outputs = result if return_outputs else (result, None)
            loss = loss / divisor if divisor != 1 else loss
            return (loss, outputs) if return_outputs else loss
        if family not in ("moe", "next", "qwen4"):  # the families whose forward adds a router's loss
            return original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch,
                            **kwargs)
        recorded: list[torch.Tensor] = []

        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            loss = output.get("loss") if isinstance(output, dict) else None
            if loss is not None and not recorded:
                recorded.append(loss.detach().clone())

        handle = model.register_forward_hook(record) if self not in _CHECKED else None
        try:
            loss, outputs = original(self, model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch,
                                     **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        aux = outputs.get("aux_loss") if isinstance(outputs, dict) else None
        if aux is not None:
            scale = stock_loss_scale(self, num_items_in_batch)
            if handle is not None and (not recorded or not torch.equal(loss.detach(), recorded[0] * scale)):
                raise RuntimeError(
                    "qwen35_accel: Trainer.compute_loss no longer returns the model's loss times "
                    f"num_processes // tp (= {scale}) as Transformers 5.24-5.25 do (model loss "
                    f"{recorded[0].item() if recorded else None}, returned {loss.item()}); the router-loss correction "
                    "(qwen35_accel/integrations/trainer_loss.py) would count the MoE router term wrongly. Install "
                    "transformers<5.26 within the tested range, or QWEN35_ACCEL=0 and check the router term by hand."
                )
            _CHECKED.add(self)
            from ...parallel.expert_parallel.router import router_loss_coefficient

            coefficient = router_loss_coefficient(inner)
            keep = 1.0 / accumulation_divisor(self, num_items_in_batch, model.training)
            if scale != keep:
                loss = loss - (scale - keep) * coefficient * aux.to(loss.dtype)
        return (loss, outputs) if return_outputs else loss

    return wrapper
