"""`Accelerator.prepare_model` for a Qwen3.5 model outside the plugin's FSDP2 path: refused under FSDP v1
(one dtype per flattened unit: the fp32 gates refused or bf16-rounded), and without FSDP (one process,
DDP) its gates held in fp32 before Accelerate wraps the model."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from ..notices import main_process_note
from ...settings import PluginSettings
from .preparation import note_restored_gates, refuse_expert_parallelism
from ..targets import is_qwen35_module


def fsdp1_asked(accelerator: Any) -> bool:
    """The run asks for FSDP v1: Accelerate's FSDP with an FSDP1 plugin, or (on a machine without
    accelerators, where Accelerate runs it as MULTI_CPU) an FSDP launch whose `FSDP_VERSION` is not 2."""
    import os

    from accelerate.utils import DistributedType

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type == DistributedType.FSDP:
        return plugin is not None and plugin.fsdp_version != 2
    launched_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    return accelerator.distributed_type == DistributedType.MULTI_CPU and launched_fsdp and os.environ.get(
        "FSDP_VERSION", "1") != "2"


def refuse_fsdp1(accelerator: Any, model: nn.Module) -> None:
    """ValueError on every rank for a Qwen3.5 model under FSDP v1 (the decision reads only the
    configuration): FSDP1 flattens each unit into one tensor of one dtype, so it refuses the fp32
    gates beside bf16 weights, or under a bf16 policy computes them bf16-rounded."""
    if not fsdp1_asked(accelerator):
        return
    from ...model.detect import unwrap_qwen35

    raise ValueError(
        f"qwen35_accel: {type(unwrap_qwen35(model)).__name__} under FSDP v1 (fsdp_version: 1, Accelerate's default "
        "when the YAML names none): FSDP1 flattens each unit into one tensor of one dtype, so it refuses the fp32 "
        "A_log/dt_bias beside bf16 weights ('Must flatten tensors with uniform dtype') or, under bf16, computes the "
        "decay gates from bf16-rounded values. qwen35_accel prepares Qwen3.5 with FSDP2: convert the YAML with "
        "`accelerate to-fsdp2 --config_file CONFIG --output_file NEW` (or set fsdp_version: 2; with the Trainer's "
        "--fsdp, fsdp_config={'version': 2}). QWEN35_ACCEL=0 leaves the run to stock Accelerate."
    )


def _without_fsdp(accelerator: Any, model: nn.Module) -> bool:
    """Accelerate prepares `model` without FSDP, DeepSpeed or Megatron (one process, DDP), and
    nothing has sharded it (no DTensor parameters: Transformers' load-time TP/FSDP, FSDP2)."""
    from accelerate.utils import DistributedType
    from torch.distributed.tensor import DTensor

    sharding = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
    if accelerator.distributed_type in sharding or getattr(model, "_is_accelerate_prepared", False):
        return False
    return not any(isinstance(p, DTensor) for p in model.parameters())


def _fp32_gates_wanted(model: nn.Module) -> bool:
    """The gates are stored below fp32 (a bf16 load) and `QWEN35_ACCEL_FP32_GATES` is on."""
    from ...model.fp32_gate import rounded_gate_dtypes

    return bool(rounded_gate_dtypes(model)) and PluginSettings.from_env(strict=True).fp32_gates


def prepare_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of `Accelerator.prepare_model`: a Qwen3.5 model (dense or MoE) prepared without FSDP whose
    gates are stored below fp32 (a bf16 load) gets the fp32 gate holders (`install_fp32_gate`)
    before Accelerate wraps it (autocast, DDP): the gates take the checkpoint's fp32 values back,
    train in fp32 and are saved in fp32. The Parameter objects are kept, so an optimizer made
    before `prepare` stays valid. Gates already in fp32 are left to Transformers' own layer, which
    computes the gate in fp32 under any autocast: nothing to fix, and one-process runs stay the
    unmodified model. `QWEN35_ACCEL_FP32_GATES=0` leaves bf16 gates as loaded."""

    @functools.wraps(original)
    def wrapper(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if is_qwen35_module(model):
            refuse_fsdp1(self, model)
        if is_qwen35_module(model) and _without_fsdp(self, model):
            refuse_expert_parallelism(model, f"Accelerate prepares this run without FSDP ({self.distributed_type})")
        if is_qwen35_module(model) and _without_fsdp(self, model) and _fp32_gates_wanted(model):
            from ...model.detect import unwrap_qwen35
            from ...model.fp32_gate import install_fp32_gate

            converted = install_fp32_gate(model)  # every GatedDeltaNet: none held its gates in fp32 yet
            if converted:
                how = "DDP" if self.num_processes > 1 else "one process"
                main_process_note(
                    f"{type(unwrap_qwen35(model)).__name__} prepared by qwen35_accel without FSDP ({how}): GatedDeltaNet "
                    f"gates A_log/dt_bias held in fp32 in {converted} layers (trained, computed and saved in fp32 under any "
                    "mixed precision; QWEN35_ACCEL_FP32_GATES=0 leaves them as loaded)"
                )
                note_restored_gates(model)
        return original(self, model, *args, **kwargs)

    return wrapper
