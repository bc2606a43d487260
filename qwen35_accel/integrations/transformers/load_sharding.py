"""Transformers' own sharding at load (`from_pretrained(..., distributed_config=DistributedConfig(...))`)
on a Qwen3.5 model (dense or MoE): the plugin's FSDP2 units where they apply, refused where Transformers'
own would train the decay gates bf16-rounded.

Transformers applies its FSDP2 plan (`base_model_fsdp_plan`: one unit per decoder layer) and its TP
plan itself, on the meta-device model before its weights load, and the Trainer then leaves the model
to it: none of Accelerate's preparation runs, so none of the plugin's. Its units hold `A_log`/`dt_bias`
in the load dtype (a bf16 load rounds them) and `fsdp_mixed_precision` casts a whole unit, gates
included, to bf16 for compute.

Data parallelism alone (FSDP2, HSDP: `fsdp_size`/`dp_replicate_size`, no tp/pp/ep; `fsdp_mixed_precision`
and `fsdp_cpu_offload` honoured; no `fsdp_plan` of the user's) is sharded by the plugin instead
(`QWEN35_ACCEL_DISTRIBUTED_CONFIG=plugin`, the default): `PARALLELIZER.apply` on Transformers' own mesh,
at the same moment (meta model, before loading), so every gate sits in an fp32 holder when the weights
load and Transformers' loader, which keeps a parameter's own dtype when it differs from the load
dtype, reads the checkpoint's fp32 values into it bitwise (`Fp32GateGatedDeltaNet.__setattr__` routes its
`setattr`). The model is then marked as Transformers marks what it shards (`_shard_as_transformers_records`),
so its Trainer and `save_pretrained` treat it as sharded at load. Any other layout (tp, pp > 1) is
left to Transformers where it is exact and refused on every rank (the decision reads only the
configuration and the load dtype, the same everywhere) where it would round the gates; Transformers'
TP plan gathers the GatedDeltaNet projections, so every rank runs all heads (correct, slower): said
once. `check` refuses and leaves as for those layouts; `stock` leaves every load to Transformers.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from ..notices import main_process_note
from ...settings import PluginSettings
from ..targets import is_qwen35_module

_PLUGIN_WAYS = (
    "qwen35_accel trains them in fp32 when Accelerate prepares the model: launch with an FSDP2 Accelerate config "
    "(accelerate launch --config_file accelerate_configs/fsdp2.yaml) or set it in TrainingArguments (fsdp=True, "
    "fsdp_config={'version': 2}, docs/torchrun.md) and load without distributed_config; or load in fp32 "
    "(dtype=torch.float32) without fsdp_mixed_precision; QWEN35_ACCEL_DISTRIBUTED_CONFIG=stock keeps Transformers' "
    "sharding as it is."
)


def plugin_shards(distributed_config: Any) -> str | None:
    """None where the plugin shards this `DistributedConfig` itself (data parallelism only), else why not."""
    sizes = {name: getattr(distributed_config, f"{name}_size", 1) or 1 for name in ("tp", "pp", "ep")}
    if others := {name: size for name, size in sizes.items() if size > 1}:
        return ", ".join(f"{name} {size}" for name, size in others.items())
    if distributed_config.dp_size <= 1:
        return "without data parallelism"
    if getattr(distributed_config, "fsdp_plan", None):
        return "an fsdp_plan of the user's"
    return None


def maybe_distribute_model(original: Any) -> classmethod:
    """The wrapper of `DistributedMixin.maybe_distribute_model` (a classmethod, called by
    `from_pretrained` after the model's init and before its weights load): see the module doc."""
    function = original.__func__

    @functools.wraps(function)
    def wrapper(cls: type, model: Any, distributed_config: Any, mesh_manager: Any) -> Any:
        if mesh_manager is not None and is_qwen35_module(model):  # dense or MoE
            mode = PluginSettings.from_env(strict=True).distributed_config
            if mode == "plugin" and plugin_shards(distributed_config) is None:
                return shard_with_the_plugin(model, distributed_config, mesh_manager)
            if mode != "stock":
                _refuse_rounded_gates(model, distributed_config)
        return function(cls, model, distributed_config, mesh_manager)

    return classmethod(wrapper)


def _refuse_rounded_gates(model: nn.Module, distributed_config: Any) -> None:
    from ...model.fp32_gate import rounded_gate_dtypes  # here: from_pretrained calls this for every model

    data_parallel = distributed_config.dp_size > 1
    reasons = []
    if (rounded := rounded_gate_dtypes(model)):
        # Every layout: Transformers' sharded model trains the gates as stored, and no preparation of
        # the plugin's that would hold them in fp32 runs on it (FSDP2 units, or TP plans' replicas).
        reasons.append(f"the load dtype stores A_log/dt_bias as {', '.join(rounded)}, and Transformers' sharded "
                       "model trains them so (the checkpoint holds them in fp32)")
    if data_parallel and getattr(distributed_config, "fsdp_mixed_precision", False):
        reasons.append("fsdp_mixed_precision computes each decoder layer's unit, gates included, from bf16 casts")
    if reasons:
        why_not = plugin_shards(distributed_config)
        ours = f"qwen35_accel shards data parallelism alone at load, not {why_not}. " if why_not else ""
        raise NotImplementedError(
            f"qwen35_accel: {type(model).__name__} with Transformers' own sharding at load "
            f"(distributed_config: dp {distributed_config.dp_size}, tp {distributed_config.tp_size}) would train "
            f"the GatedDeltaNet decay gates bf16-rounded: {'; '.join(reasons)}. {ours}{_PLUGIN_WAYS}"
        )
    if distributed_config.tp_size > 1:
        main_process_note(
            f"{type(model).__name__}: Transformers' TP plan (distributed_config tp {distributed_config.tp_size}) "
            "gathers the GatedDeltaNet projections, so every rank runs all of their heads; qwen35_accel's "
            "head-parallel TP runs when Accelerate prepares the model (accelerate_configs/fsdp2_tp2.yaml)"
        )


def _shard_as_transformers_records(model: nn.Module, distributed_config: Any, mesh_manager: Any) -> None:
    """What Transformers' `maybe_distribute_model` (5.24, 5.25) records on a model it shards, read by its
    Trainer (no Accelerate wrapping, no device placement, FSDP2 no_sync) and its distributed save."""
    model.config.distributed_config = distributed_config
    model._mesh_manager = mesh_manager
    model._device_mesh = mesh_manager.get_mesh(("pp", "fsdp", "tp"))
    model._is_distributed_loading_by_transformers = True
    model._tp_size = distributed_config.tp_size
    model._fsdp_size = distributed_config.fsdp_size
    model._is_fsdp_managed_module = True


def shard_with_the_plugin(model: nn.Module, distributed_config: Any, mesh_manager: Any) -> nn.Module:
    """Shard `model` (Qwen3.5, dense or MoE, on the meta device or materialised, not yet sharded) into the
    plugin's dtype-uniform FSDP2 units over Transformers' data-parallel mesh ("fsdp", with
    "dp_replicate" for HSDP), with the `QWEN35_ACCEL_*` settings that apply without an Accelerator.
    Returns `model` (the same object, FSDP2's class)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from ...model.fp32_gate import rounded_gate_dtypes
    from ...parallelization import PARALLELIZER
    from ...settings import check_same_on_every_rank

    settings = PluginSettings.from_env(strict=True)
    check_same_on_every_rank(settings)
    rounded = rounded_gate_dtypes(model)  # the load dtype, before the holders take the gates
    _shard_as_transformers_records(model, distributed_config, mesh_manager)
    replicate = distributed_config.dp_replicate_size > 1
    mesh = mesh_manager.get_mesh(("dp_replicate", "fsdp") if replicate else "fsdp")
    mixed = bool(distributed_config.fsdp_mixed_precision)
    settings = settings.with_parallel(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None,
        offload_policy=CPUOffloadPolicy() if distributed_config.fsdp_cpu_offload else None,
    )
    PARALLELIZER.apply(model, mesh, "fsdp", settings=settings, source="distributed_config")
    from ...parallel.prepared import prepared_state
    from ..prepared_line import loss_in_effect

    state = prepared_state(model)

    loaded = (f" (the checkpoint's values load into them in fp32, the rest in {', '.join(rounded)})" if rounded else "")
    main_process_note(
        f"{type(model).__name__.removeprefix('FSDP')} sharded at load by qwen35_accel (distributed_config: "
        f"dp_replicate {distributed_config.dp_replicate_size}, fsdp {distributed_config.fsdp_size}"
        f"{', fsdp_mixed_precision: bf16 compute' if mixed else ''}): dtype-uniform FSDP2 units, fp32 gate holders"
        f"{loaded}, loss: {loss_in_effect(model)}; QWEN35_ACCEL_DISTRIBUTED_CONFIG=stock leaves it to Transformers"
    )
    return model
