"""DeepSpeed's patch points, declared as data; `integrations/patches.py` registers them with the others.
DeepSpeed is optional: these points wait until DeepSpeed's modules are imported (Accelerate imports them
when it prepares a DeepSpeed run), and act only within the DeepSpeed guard's range."""

from __future__ import annotations

from ..activation import DEEPSPEED, PatchPoint
from . import engine_checkpoints, engine_steps

DEEPSPEED_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(
        "deepspeed.runtime.engine", "DeepSpeedEngine._take_model_step", engine_steps.take_model_step, DEEPSPEED,
        "a Qwen3.5-family model whose gates the plugin keeps outside the engine: at the accumulation boundary their "
        "fp32 gradients averaged over the data-parallel group first, then DeepSpeed's step, then theirs (fp32, the "
        "user's optimizer class and hyperparameters, DeepSpeed's learning rates and clip coefficient; stock: the "
        "gates are bf16 parameters of the engine under bf16)",
    ),
    PatchPoint(
        "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.scaled_global_norm",
        engine_steps.zero12_scaled_global_norm, DEEPSPEED,
        "ZeRO-1/2 during such a step: the global gradient norm counts the gates' gradients (its clipping and the "
        "logged grad_norm cover the whole model)",
    ),
    PatchPoint(
        "deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._get_norm_groups",
        engine_steps.zero3_norm_groups, DEEPSPEED,
        "ZeRO-3 during such a step: the gates' gradient norm one more norm group (as ZeRO-1/2 above)",
    ),
    PatchPoint(
        "deepspeed.runtime.engine", "DeepSpeedEngine.save_checkpoint", engine_checkpoints.save_checkpoint, DEEPSPEED,
        "DeepSpeed's own checkpoint of such a model (the Trainer's periodic checkpoints): the gates' fp32 values and "
        "their optimizer's state in the model-states file under one client-state key (stock: the engine knows of "
        "no parameter outside it)",
    ),
    PatchPoint(
        "deepspeed.runtime.engine", "DeepSpeedEngine.load_checkpoint", engine_checkpoints.load_checkpoint, DEEPSPEED,
        "resuming such a checkpoint (the Trainer's resume_from_checkpoint): the gates' values and optimizer state "
        "restored from that key, which the returned client state no longer carries",
    ),
    PatchPoint(
        "deepspeed.runtime.engine", "DeepSpeedEngine._get_buffer_names", engine_checkpoints.get_buffer_names, DEEPSPEED,
        "the names DeepSpeed's zero_to_fp32 restores from the model states: the gates listed too, so the consolidated "
        "fp32 state dict has them",
    ),
)
