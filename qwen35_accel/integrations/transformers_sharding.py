"""Transformers' own sharding at load (`from_pretrained(..., distributed_config=DistributedConfig(...))`)
on a dense Qwen3.5 model: refused where it would train the decay gates bf16-rounded.

Transformers applies its FSDP2 plan (`base_model_fsdp_plan`: one unit per decoder layer) and its TP
plan itself while loading, and the Trainer then leaves the model to it: none of Accelerate's
preparation runs, so none of the plugin's. Its units hold `A_log`/`dt_bias` in the load dtype (a
bf16 load rounds them; nothing reads the checkpoint's fp32 values back) and
`fsdp_mixed_precision` casts a whole unit, gates included, to bf16 for compute: in both cases the
gates train bf16-rounded, silently. Those loads are refused on every rank (the decision reads only
the configuration and the load dtype, the same everywhere) with the ways that train them in fp32.
An fp32 load without `fsdp_mixed_precision` is exact and left to Transformers; its TP plan gathers
the GatedDeltaNet projections, so every rank runs all heads (correct, slower): said once.
`QWEN35_ACCEL_DISTRIBUTED_CONFIG=stock` leaves every load to Transformers.
"""

from __future__ import annotations

import functools
from typing import Any

from .notices import main_process_note
from .settings import PluginSettings
from .targets import is_dense_qwen35_module

_PLUGIN_WAYS = (
    "qwen35_accel trains them in fp32 when Accelerate prepares the model: launch with an FSDP2 Accelerate config "
    "(accelerate launch --config_file accelerate_configs/fsdp2.yaml) or set it in TrainingArguments (fsdp=True, "
    "fsdp_config={'version': 2}, docs/torchrun.md) and load without distributed_config; or load in fp32 "
    "(dtype=torch.float32) without fsdp_mixed_precision; QWEN35_ACCEL_DISTRIBUTED_CONFIG=stock keeps Transformers' "
    "sharding as it is."
)


def maybe_distribute_model(original: Any) -> classmethod:
    """The wrapper of `DistributedMixin.maybe_distribute_model` (a classmethod, called by
    `from_pretrained` after the model's init and before its weights load): see the module doc."""
    function = original.__func__

    @functools.wraps(function)
    def wrapper(cls: type, model: Any, distributed_config: Any, mesh_manager: Any) -> Any:
        if (
            mesh_manager is not None and is_dense_qwen35_module(model)
            and PluginSettings.from_env(strict=True).distributed_config == "check"
        ):
            from ..model.fp32_gate import rounded_gate_dtypes  # here: from_pretrained calls this for every model

            data_parallel = distributed_config.dp_size > 1
            reasons = []
            if data_parallel and (rounded := rounded_gate_dtypes(model)):
                reasons.append(f"the load dtype stores A_log/dt_bias as {', '.join(rounded)}, and Transformers' FSDP2 "
                               "units train them so (the checkpoint holds them in fp32)")
            if data_parallel and getattr(distributed_config, "fsdp_mixed_precision", False):
                reasons.append("fsdp_mixed_precision computes each decoder layer's unit, gates included, from bf16 casts")
            if reasons:
                raise NotImplementedError(
                    f"qwen35_accel: {type(model).__name__} with Transformers' own sharding at load "
                    f"(distributed_config: dp {distributed_config.dp_size}, tp {distributed_config.tp_size}) would train "
                    f"the GatedDeltaNet decay gates bf16-rounded: {'; '.join(reasons)}. {_PLUGIN_WAYS}"
                )
            if distributed_config.tp_size > 1:
                main_process_note(
                    f"{type(model).__name__}: Transformers' TP plan (distributed_config tp {distributed_config.tp_size}) "
                    "gathers the GatedDeltaNet projections, so every rank runs all of their heads; qwen35_accel's "
                    "head-parallel TP runs when Accelerate prepares the model (accelerate_configs/fsdp2_tp2.yaml)"
                )
        return function(cls, model, distributed_config, mesh_manager)

    return classmethod(wrapper)
