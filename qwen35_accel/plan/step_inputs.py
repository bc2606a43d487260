"""The memory of one training step as the YAML, the plugin's settings and `plan`'s options
describe it: the memory model's inputs (`qwen35_accel.memory`) and its report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import PlannedRun, PlanError


@dataclass(frozen=True)
class Precision:
    """Bytes per element: `storage` as loaded, `param` as FSDP2 holds the trainable
    parameters (fp32 masters under a bf16/fp16 policy), `compute` under the policy."""

    storage: int
    param: int
    compute: int


def step_memory(
    model_config: Any, sizes: dict[str, int], precision: Precision, run: PlannedRun, settings: Any, *,
    seq_len: int, batch_size: int, optimizer: str, activation_checkpointing: bool, vision_tower: str, image_tokens: int,
    activation_offload: bool = False,
    gpu_memory: int | None, suggest: bool, reference_model: bool = False,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(`memory_report`'s keys for `plan --json`, the vision tower's step figures for its
    report: `image_tokens`, `patches_per_rank`, `cp`, `memory_per_rank`; None for a text step).
    The kernels are the `run`'s: torch's on "cpu", FLA's and causal-conv1d's on "cuda"."""
    from ..memory import ModelShape, Parallel, StepOptions, VisionShape, VisionTower, memory_report, vision_estimate

    prefetch = settings.parallel.enable_fsdp2_prefetch
    try:
        step = StepOptions(
            seq_len=seq_len, batch_size=batch_size, compute_bytes=precision.compute, optimizer=optimizer,
            param_bytes=precision.param, activation_checkpointing=activation_checkpointing, tiled_loss=settings.parallel.tiled_loss,
            activation_offload=activation_offload,
            forward_prefetch_depth=settings.parallel.fsdp2_forward_prefetch_depth if prefetch else 0,
            backward_prefetch_depth=settings.parallel.fsdp2_backward_prefetch_depth if prefetch else 0,
            device=run.device,  # type: ignore[arg-type]
            fla=run.kernels == "fla",
            reference_model=reference_model,
            reference_bytes=precision.storage,
        )
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    parallel = Parallel(sizes["dp_replicate"], sizes["dp_shard"], sizes["cp"], sizes["tp"], settings.parallel.vocab_parallel_lm_head,
                        ep=settings.parallel.ep)
    vision, tower = None, None
    if vision_tower != "none":
        vision = VisionTower(
            VisionShape.from_config(model_config), trainable=vision_tower == "trainable",  # type: ignore[arg-type]
            frozen_sharding=settings.parallel.frozen_multimodal_sharding, image_tokens=image_tokens, storage_bytes=precision.storage,
        )
        tower = {"image_tokens": image_tokens, "patches_per_rank": vision.patches_per_rank(parallel), "cp": sizes["cp"],
                 "memory_per_rank": vision_estimate(vision, parallel, step).as_dict()}
    report = memory_report(ModelShape.from_config(model_config), parallel, step, gpu_memory, suggest, vision)
    return report, tower
