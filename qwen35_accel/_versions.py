"""Supported dependency versions, checked at import from package metadata (cheap: no
torch/transformers import happens here)."""

from __future__ import annotations

import os
import re
import warnings
from importlib import metadata

# name -> (minimum inclusive, maximum exclusive, why these bounds). Both ends are what the test
# suite ran with (README: Supported versions), and equal pyproject.toml's dependency ranges and,
# for accelerate and transformers, the plugin's guards (integrations/activation.py):
# tests/test_versions.py holds the three together.
SUPPORTED: dict[str, tuple[str, str, str]] = {
    "torch": ("2.11", "2.16", "the torch releases the test suite ran with: FSDP2, DeviceMesh flattening, DTensor"),
    "transformers": ("5.24", "5.26", "the Qwen3.5 modeling code whose GatedDeltaNet forward qwen35_accel mirrors"),
    "accelerate": ("1.15", "1.17", "ParallelismConfig and the FSDP2 preparation path qwen35_accel hooks"),
}


def _release(version: str) -> tuple[int, ...]:
    """`'2.13.0+cpu'` -> `(2, 13, 0)`; pre-release and local tags are dropped."""
    parts = []
    for piece in version.split("+")[0].split("."):
        m = re.match(r"\d+", piece)
        if m is None:
            break
        parts.append(int(m.group()))
    return tuple(parts)


def is_supported(name: str, version: str) -> bool:
    """Whether `version` of package `name` lies in its SUPPORTED range."""
    lo, hi, _why = SUPPORTED[name]
    return _release(lo) <= _release(version) < _release(hi)


def check_versions(required: tuple[str, ...] = ("torch", "transformers")) -> dict[str, str]:
    """Raise ImportError naming every installed version of a `required` package outside SUPPORTED.

    The core (`PARALLELIZER.apply`) needs torch and Transformers; Accelerate is needed by
    the plugin alone, which checks its own version and stays off (saying why) outside its
    tested range, so an unsupported Accelerate does not stop the import. Returns the
    installed versions by name.
    """
    found: dict[str, str] = {}
    problems: list[str] = []
    for name, (lo, hi, why) in SUPPORTED.items():
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name in required:
                problems.append(f"{name} is not installed; qwen35-accel needs {name}>={lo},<{hi} ({why})")
            continue
        if name in required and not is_supported(name, found[name]):
            problems.append(f"{name} {found[name]} is installed; qwen35-accel supports {name}>={lo},<{hi} ({why})")
    if problems:
        message = (
            "qwen35-accel cannot run with these versions:\n  - "
            + "\n  - ".join(problems)
            + "\nInstall a supported set, e.g. `pip install torch==2.13.0 transformers==5.24.0 accelerate==1.16.0`"
            + " (QWEN35_ACCEL_IGNORE_VERSIONS=1 turns this into a warning, for experiments at your own risk)."
        )
        if os.environ.get("QWEN35_ACCEL_IGNORE_VERSIONS", "").strip().lower() in ("1", "true", "yes", "on"):
            warnings.warn(message, stacklevel=2)
            return found
        raise ImportError(message)
    return found
