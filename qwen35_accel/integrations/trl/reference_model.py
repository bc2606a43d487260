"""TRL's reference model (`prepare_fsdp` and `prepare_deepspeed` as DPO, KTO, GRPO and RLOO import
them): a dense Qwen3.5 reference under FSDP2 is prepared as the policy is
(`accelerate/several_models.prepare_extra_model`: our units, fp32 gate holders, the accelerator's cp/tp
layers) instead of TRL's one `fully_shard` on the whole model; a Qwen3.5-family model TRL hands to
DeepSpeed itself keeps its gates fp32 (DeepSpeed casts every parameter it sees to bf16 in bf16 mode)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from ..accelerate.several_models import prepare_extra_model
from ..notices import main_process_note
from ..targets import is_dense_qwen35_module, is_qwen35_module, prepared_by_accelerate
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


def trl_prepare_deepspeed(trainer: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper of TRL's `prepare_deepspeed(model, accelerator)` as `trainer`'s module imports it (its
    reference model, reward models, DPO's and KTO's precompute engine): a Qwen3.5-family model's gates go
    into fp32 holders hidden from the inference engine DeepSpeed builds (the checkpoint's values after a
    bf16 load; zero.Init-partitioned ones gathered), read in fp32 by every forward, never stepped. Below
    ZeRO-3 TRL's engine is stage 0 (no partitioning, no optimizer): the holders then return to the module
    tree, so a model prepared again later (DPO's precompute engine is the policy itself) is prepared as any."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(model: nn.Module, accelerator: Any) -> Any:
            if model is None or not is_qwen35_module(model):
                return original(model, accelerator)
            from ...model.detect import unwrap_qwen35
            from ...model.state import own_state
            from ..accelerate.deepspeed_preparation import keep_gates_outside
            from ..deepspeed.gates import DeepSpeedGates, show_holders

            holders, _ = keep_gates_outside(model)
            gates = DeepSpeedGates(holders=holders, optimizer=None, follows=[])
            engine = original(model, accelerator)
            gates.attach(engine)
            stage = engine.zero_optimization_stage()
            if stage == 3:
                own_state(unwrap_qwen35(model)).deepspeed_gates = gates
            else:
                show_holders(model)
            main_process_note(
                f"{type(model).__name__} ({trainer}'s reference or reward model, TRL's prepare_deepspeed) prepared by "
                f"qwen35_accel for DeepSpeed's inference engine (ZeRO-{stage}): {len(holders)} GatedDeltaNet gate holders "
                "(A_log/dt_bias) in fp32, hidden from the engine's cast — read in fp32 by every forward, never stepped"
            )
            return engine

        return wrapper

    return wrap
