"""qwen35-accel: Qwen3.5 models and their GatedDeltaNet family (dense and MoE, text and vision, classifier heads,
Qwen3-Next, Qwen4-Exp) under FSDP2, CP, TP and EP, for Accelerate and the Transformers Trainer.

Importing this package is cheap: it checks dependency versions from metadata and loads
the heavy modules (torch, transformers) only when a public name is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._versions import check_versions

__version__ = "0.1.0"

check_versions()

_LAZY = {
    "PARALLELIZER": ("qwen35_accel.parallelization", "PARALLELIZER"),
    "Qwen3_5ModelParallelizer": ("qwen35_accel.parallelization", "Qwen3_5ModelParallelizer"),
    "install_fp32_gate": ("qwen35_accel.model.fp32_gate", "install_fp32_gate"),
    "is_dense_qwen35": ("qwen35_accel.model.detect", "is_dense_qwen35"),
}


def install() -> bool:
    """Activate the Accelerate plugin in this process now (idempotent; imports Accelerate).

    Works whatever `QWEN35_ACCEL` says (an explicit call wins). Returns False, with a
    warning, when the installed Accelerate is outside the plugin's tested range.
    """
    from .integrations.plugin import install as _install

    return _install()


__all__ = ["__version__", "install", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    from .model.detect import is_dense_qwen35
    from .model.fp32_gate import install_fp32_gate
    from .parallelization import PARALLELIZER, Qwen3_5ModelParallelizer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qwen35_accel' has no attribute {name!r}")
