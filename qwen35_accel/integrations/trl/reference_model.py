"""TRL's reference model (`prepare_fsdp` as DPO, KTO, GRPO and RLOO import it): a dense Qwen3.5
reference under FSDP2 is prepared as the policy is (`accelerate/several_models.prepare_extra_model`:
our units, fp32 gate holders, the accelerator's cp/tp layers) instead of TRL's one `fully_shard` on
the whole model."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from ..accelerate.several_models import prepare_extra_model
from ..targets import is_dense_qwen35_module, prepared_by_accelerate
from .trainers import trl_under_cp_error


def trl_prepare_fsdp(trainer: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper of TRL's `prepare_fsdp(model, accelerator)` as `trainer`'s module imports it
    (its reference model): for a dense Qwen3.5 model under FSDP2, `prepare_extra_model`, in
    eval mode, as TRL leaves it. Under context parallelism DPO, KTO, GRPO and RLOO (TRL 1.16)
    get their reference model's log-probabilities of whole rows as the policy's
    (`trl_whole_rows`); with another TRL they are refused."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(model: nn.Module, accelerator: Any) -> nn.Module:
            plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
            if is_dense_qwen35_module(model) and plugin is not None and plugin.fsdp_version == 2 and not prepared_by_accelerate(model):
                parallelism = getattr(accelerator, "parallelism_config", None)
                if parallelism is not None and parallelism.cp_enabled:
                    from .whole_rows import whole_rows_supported

                    supported, trl_version = whole_rows_supported(trainer)
                    if not supported:
                        raise trl_under_cp_error(trainer, parallelism.cp_size, trl_version)
                model = prepare_extra_model(accelerator, model, register=False)
                model.eval()
                return model
            return original(model, accelerator)

        return wrapper

    return wrap
