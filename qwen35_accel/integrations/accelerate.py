"""The Accelerate plugin's public face: `install()`, `uninstall()`, `status()`, `PATCH_POINTS`.

For a dense Qwen3.5 model, Accelerate's FSDP2 preparation hands over to
`PARALLELIZER.apply` (dtype-uniform units, CP and TP layers) with the settings of the
`FullyShardedDataParallelPlugin` and the accelerator's device mesh, and the per-step
context-parallel context shards the batch with our layout. Every other model takes
Accelerate's own path. On machines without accelerators an FSDP config runs FSDP2 over
gloo (for every model) instead of silently training N independent copies.

The package holds one module per concern: `patches` (the registry: each point's target,
guard and wrapper; install, uninstall, status), `cpu_backend` (gloo on CPU, the bounded
exit teardown), `preparation` (FSDP2/TP/CP preparation), `step_hooks` (per-step CP
sharding, clipping), `checkpoints` (TP checkpoint loading, the Trainer's save and resume),
`settings` (the `QWEN35_ACCEL_*` knobs). Activation at interpreter start lives in
`qwen35_accel_autoload` (a torch entry point).
"""

from __future__ import annotations

from .patches import (
    PATCH_POINTS,
    TESTED_ACCELERATE,
    TESTED_TRANSFORMERS,
    PatchPoint,
    VersionGuard,
    accelerate_version_supported,
    install,
    status,
    uninstall,
)
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
