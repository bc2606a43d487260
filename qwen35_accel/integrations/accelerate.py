"""The Accelerate plugin's public face: `install()`, `uninstall()`, `status()`, `PATCH_POINTS`.

For a dense Qwen3.5 model, Accelerate's FSDP2 preparation hands over to
`PARALLELIZER.apply` (dtype-uniform units, CP and TP layers) with the settings of the
`FullyShardedDataParallelPlugin` and the accelerator's device mesh, and the per-step
context-parallel context shards the batch with our layout. Every other model takes
Accelerate's own path. On machines without accelerators an FSDP config runs FSDP2 over
gloo (for every model) instead of silently training N independent copies.

The package holds one module per concern: `patches` (the registry: each point's target,
guard and wrapper, declared as data), `activation` (install, uninstall, status over the
registered points; it imports no wrapper), `cpu_backend` (gloo on CPU, the bounded exit
teardown), `preparation` (FSDP2/TP/CP preparation), `compilation` (Accelerate's dynamo_config
compiled per layer), `transformers_sharding` (Transformers' `distributed_config` at load),
`step_hooks` (per-step CP padding and
sharding, clipping), `evaluation` (gathering and whole logits for evaluation),
`several_models` (a frozen reference model beside the policy), `trl_trainers` (which TRL
trainers are refused where, and why), `checkpoints` (TP checkpoint loading, the Trainer's
save and resume), `targets` (which models the points act on), `notices` (what the plugin
tells the user), `settings` (the `QWEN35_ACCEL_*` knobs). Activation at interpreter start
lives in `qwen35_accel_autoload` (a torch entry point).
"""

from __future__ import annotations

from .activation import (
    TESTED_ACCELERATE,
    TESTED_TRANSFORMERS,
    PatchPoint,
    VersionGuard,
    accelerate_version_supported,
    install,
    status,
    uninstall,
)
from .patches import PATCH_POINTS
from .preparation import prepare_qwen35_fsdp2

__all__ = [
    "PATCH_POINTS",
    "TESTED_ACCELERATE",
    "TESTED_TRANSFORMERS",
    "PatchPoint",
    "VersionGuard",
    "accelerate_version_supported",
    "install",
    "prepare_qwen35_fsdp2",
    "status",
    "uninstall",
]
