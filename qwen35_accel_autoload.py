"""Activates the qwen35_accel Accelerate plugin in every Python process, cheaply.

Registered as a `torch.backends` entry point: torch calls `activate()` at the end of
`import torch` (unless TORCH_DEVICE_BACKEND_AUTOLOAD=0), after `pip install .` and
`pip install -e .` alike. It runs inside torch's import, so it imports nothing heavy
and never raises: it only adds an import hook that patches Accelerate once Accelerate's
`Accelerator` exists. `QWEN35_ACCEL=0` turns it off.

This module lives outside the `qwen35_accel` package on purpose: importing the package
checks dependency versions and may raise, which must never break `import torch`.
"""

from __future__ import annotations

import os
import sys
import warnings

_OFF = {"0", "false", "no", "off"}


def _accelerate_ready() -> bool:
    accelerator = sys.modules.get("accelerate.accelerator")
    state = sys.modules.get("accelerate.state")
    fsdp_utils = sys.modules.get("accelerate.utils.fsdp_utils")
    return (
        accelerator is not None
        and hasattr(accelerator, "Accelerator")
        and hasattr(state, "AcceleratorState")
        and hasattr(fsdp_utils, "fsdp2_prepare_model")
    )


class _AccelerateWatcher:
    """A meta-path finder that finds nothing: it only looks, at each import, whether
    Accelerate's classes exist yet, installs the plugin once, then removes itself."""

    def __init__(self) -> None:
        self._busy = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if self._busy or "accelerate.accelerator" not in sys.modules or not _accelerate_ready():
            return None
        self._busy = True
        try:
            _remove_watcher()
            _install()
        finally:
            self._busy = False
        return None


def _install() -> None:
    try:
        import qwen35_accel

        qwen35_accel.install()
    except Exception as error:  # never break the user's import
        warnings.warn(f"qwen35_accel: the Accelerate plugin could not be activated: {error}", stacklevel=2)


def _remove_watcher() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AccelerateWatcher)]


def activate() -> None:
    """Entry point: install the plugin now if Accelerate is loaded, else watch for it."""
    try:
        if os.environ.get("QWEN35_ACCEL", "1").strip().lower() in _OFF:
            return
        if _accelerate_ready():
            _install()
        elif not any(isinstance(f, _AccelerateWatcher) for f in sys.meta_path):
            sys.meta_path.insert(0, _AccelerateWatcher())
    except Exception as error:  # pragma: no cover - defensive: torch's import must survive
        warnings.warn(f"qwen35_accel: autoload failed: {error}", stacklevel=2)
