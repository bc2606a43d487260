"""The MoE router's load-balancing loss counted once per step through the plain Trainer.

The objective a step optimises (docs/moe.md, "The router's loss in a step"):

    CE over the global batch's labelled tokens  +  router_aux_loss_coef × R

R is the mean over the step's router losses: one per data-parallel replica and micro-batch by
default (each replica's rows, whole rows under cp), one per micro-batch of the global batch with
`QWEN35_ACCEL_MOE_BALANCE=global`.

Stock `Trainer.compute_loss` (Transformers 5.24, 5.25; issue 48690) multiplies the model's whole
loss by `num_processes // tp` when it normalises the cross entropy by the global token count
(`average_tokens_across_devices`, the default, with `num_items_in_batch`), to undo the gradient
average over the data-parallel ranks: the router term, a per-rank mean that the average already
treats right, rides along — `num_processes` times the configured coefficient. With
`num_items_in_batch` it also leaves gradient accumulation to the loss, so the router term is added
once per micro-batch: `gradient_accumulation_steps` times more. `trainer_compute_loss` takes both
factors back off the router term (the cross entropy keeps the Trainer's scaling), so any world
size, layout and accumulation count trains with the coefficient as configured.

TRL's trainers do not go through here (they override `compute_loss` and add the router term each
their own way, unmultiplied: docs/moe.md); a Trainer subclass that calls `super().compute_loss`
does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _moe_model(model: nn.Module) -> nn.Module | None:
    """The Qwen3.5-MoE model inside what the Trainer calls (DDP's `.module`, torch.compile's and
    PEFT's wrappers looked through; FSDP2 keeps the module itself), or None."""
    from ..model.detect import qwen35_family, unwrap_qwen35

    inner = getattr(model, "module", model)
    if not isinstance(inner, nn.Module) or qwen35_family(inner) != "moe":
        return None
    return unwrap_qwen35(inner)


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


def accumulation_divisor(trainer: Any, num_items_in_batch: Any) -> int:
    """By how much the router term of one micro-batch must be divided in the loss `compute_loss`
    returns: the accumulation steps when `training_step` will not divide the loss itself (the loss
    counts as already scaled for accumulation, as the Trainer decides it), else 1."""
    scaled = trainer.loss_is_scaled_for_ga
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or trainer.compute_loss_func is not None
    return trainer.current_gradient_accumulation_steps if scaled else 1


def _router_term_applies(trainer: Any, model: nn.Module, inputs: dict[str, Any]) -> bool:
    """Whether the model's own loss (labels passed to it, no custom loss) is what compute_loss returns."""
    if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
        return False  # the labels are taken out: the model's loss (router term included) is not used
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled:
        return False  # DeepSpeed's sequence-parallel loss: its own path
    return inputs.get("labels") is not None and _moe_model(model) is not None


def trainer_compute_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of `Trainer.compute_loss`: on a Qwen3.5-MoE model whose forward adds the router's
    loss (`aux_loss` in its output), the returned loss carries `coef × aux / accumulation` instead of
    stock's `coef × aux × num_processes // tp` (see the module docstring); the cross entropy keeps the
    Trainer's scaling. Every other model and call is stock.

    The stock scaling is checked at every call: the model's loss, recorded as it leaves the forward,
    times `stock_loss_scale` must equal what the original returns bitwise, else RuntimeError (a
    Transformers release that changed the scaling, or fixed issue 48690, would be corrected twice)."""

    @functools.wraps(original)
    def wrapper(self: Any, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        if not _router_term_applies(self, model, inputs):
            return original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch,
                            **kwargs)
        recorded: list[torch.Tensor] = []

        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            loss = output.get("loss") if isinstance(output, dict) else None
            if loss is not None and not recorded:
                recorded.append(loss.detach().clone())

        handle = model.register_forward_hook(record)
        try:
            loss, outputs = original(self, model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch,
                                     **kwargs)
        finally:
            handle.remove()
        aux = outputs.get("aux_loss") if isinstance(outputs, dict) else None
        if aux is not None:
            scale = stock_loss_scale(self, num_items_in_batch)
            if not recorded or not torch.equal(loss.detach(), recorded[0] * scale):
                raise RuntimeError(
                    "qwen35_accel: Trainer.compute_loss no longer returns the model's loss times "
                    f"num_processes // tp (= {scale}) as Transformers 5.24-5.25 do (model loss "
                    f"{recorded[0].item() if recorded else None}, returned {loss.item()}); the router-loss correction "
                    "(qwen35_accel/integrations/router_loss.py) would count the MoE router term wrongly. Install "
                    "transformers<5.26 within the tested range, or QWEN35_ACCEL=0 and check the router term by hand."
                )
            from ..parallel.moe import router_loss_coefficient

            coefficient = router_loss_coefficient(_moe_model(model))
            keep = 1.0 / accumulation_divisor(self, num_items_in_batch)
            if scale != keep:
                loss = loss - (scale - keep) * coefficient * aux.to(loss.dtype)
        return (loss, outputs) if return_outputs else loss

    return wrapper
