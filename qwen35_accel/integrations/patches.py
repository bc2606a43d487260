"""The plugin's patch points: one registry, each point with its target, guard and wrapper.

Each patch point wraps one attribute of Accelerate or the Trainer and calls the original
for anything that is not a model it acts on (a Qwen3.5-family model: Qwen3.5 dense and MoE, Qwen3-Next,
Qwen4-Exp; some points dense Qwen3.5 only, as each says). This module is data: it imports the
wrappers and declares the points; `activation` (which imports no wrapper) installs them
(`install()` is idempotent), restores the originals (`uninstall()`) and reports what is
active and why not (`status()`). The public names are in `accelerate.py`.
"""

from __future__ import annotations

from . import activation
from .accelerate.accelerate_points import ACCELERATE_POINTS
from .activation import PatchPoint
from .deepspeed.deepspeed_points import DEEPSPEED_POINTS
from .transformers.trainer_points import TRANSFORMERS_POINTS
from .trl.trl_points import TRL_POINTS

PATCH_POINTS: tuple[PatchPoint, ...] = (*ACCELERATE_POINTS, *TRANSFORMERS_POINTS, *TRL_POINTS, *DEEPSPEED_POINTS)

activation.register(PATCH_POINTS)
