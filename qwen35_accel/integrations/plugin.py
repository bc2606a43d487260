"""The Accelerate plugin's public face: `install()`, `uninstall()`, `status()`, `PATCH_POINTS`.

For a Qwen3.5-family model, Accelerate's FSDP2 preparation hands over to
`PARALLELIZER.apply` (dtype-uniform units, CP and TP layers) with the settings of the
`FullyShardedDataParallelPlugin` and the accelerator's device mesh, and the per-step
context-parallel context shards the batch with our layout. Every other model takes
Accelerate's own path. On machines without accelerators an FSDP config runs FSDP2 over
gloo (for every model) instead of silently training N independent copies.

The package is laid out by upstream: `accelerate/`, `transformers/`, `trl/` and `deepspeed/` each hold their
wrappers and declare their patch points as data (`*_points.py`); `patches` registers them;
`activation` installs, uninstalls and reports over the registered points (it imports no
wrapper); `targets`, `notices`, `prepared_line` and `parallelism_layouts` serve all
three (docs/layout.md lists every module). Activation at interpreter start lives in
`qwen35_accel_autoload` (a torch entry point).
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
from .accelerate.preparation import prepare_qwen35_fsdp2

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
