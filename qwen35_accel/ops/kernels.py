"""Which optional CUDA kernels this process can use, decided once: FLA's chunked gated delta
rule (package `flash-linear-attention`, module `fla`) and causal-conv1d's conv.

A package counts as usable only if it imports (an installed package that fails to import,
e.g. causal-conv1d built for another torch, is reported with its error), is recent enough and
has the function and arguments we call. Each probe imports once per process and is cached
(`reset()` clears the caches, for tests).

Transformers decides for itself, once, when `modeling_qwen3_5` is imported: its
`torch_chunk_gated_delta_rule` / `causal_conv1d_fn` become FLA's / causal-conv1d's functions
whenever those import (no version check), on any device, and its torch fallbacks raise on
`cu_seqlens` / `seq_idx`. `transformers_uses` reads that decision; a GatedDeltaNet forward
may hand packed rows to a varlen kernel only where both agree (`varlen_ok`), and takes the
torch kernels where Transformers would call a package found unusable here.

The kernels run on CUDA tensors only; on CPU the torch kernels run whatever is installed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata as md
import importlib.util
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# FLA before 0.5.0 is not used: up to 0.3.x `chunk_gated_delta_rule` asserts that q/k/v are
# not fp32 (our CP chunk summaries pass fp32), and before 0.5.0 it takes one head count for
# q, k and v (no grouped value heads; every published Qwen3.5 has 16 key and 32 or 48 value
# heads, and Transformers hands it q/k with the key heads). Read from the 0.3.2, 0.4.x and
# 0.5.x wheels' `fla/ops/gated_delta_rule/chunk.py`.
MIN_FLA = "0.5.0"

FLA_FUNCTION = ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
CONV_FUNCTION = ("causal_conv1d", "causal_conv1d_fn")
# Where the version comes from, first found: from 0.3.2 on the `fla` ops ship in fla-core (which
# flash-linear-attention requires); before, in flash-linear-attention itself.
DISTRIBUTIONS = {"fla": ("fla-core", "flash-linear-attention"), "causal_conv1d": ("causal-conv1d",)}
# The Transformers function that names each package's kernel (see module doc).
TRANSFORMERS_FUNCTIONS = {"fla": "torch_chunk_gated_delta_rule", "causal_conv1d": "causal_conv1d_fn"}


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """What a probe of one package found. `usable`: we call its kernel on CUDA tensors."""

    package: str  # import name: "fla" or "causal_conv1d"
    distribution: str  # what `pip install` takes
    version: str | None  # installed distribution's version (None: not installed)
    usable: bool
    reason: str  # why not usable, or what is used
    function: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    def line(self) -> str:
        """One line for `env` and the prepared line: package, version, verdict."""
        version = self.version or "not installed"
        return f"{self.distribution} {version}: {'used on CUDA' if self.usable else 'NOT used'} ({self.reason})"


def _version(package: str) -> tuple[str, str | None]:
    for dist in DISTRIBUTIONS[package]:
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return DISTRIBUTIONS[package][-1], None  # not installed: name what `pip install` takes


def _parse(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string ("0.5.2.dev1" -> (0, 5, 2))."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def _import(module: str, name: str) -> tuple[Callable[..., Any] | None, str | None]:
    """(function, None), or (None, the import's error) — any Exception: a broken build
    raises ImportError, OSError (a missing .so), RuntimeError or AttributeError alike."""
    try:
        return getattr(importlib.import_module(module), name), None
    except Exception as exc:  # noqa: BLE001 (reported, never raised)
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}".rstrip(": ")


@functools.cache
def fla_status() -> KernelStatus:
    """FLA's `chunk_gated_delta_rule`: installed, importable, >= MIN_FLA, backward runnable here."""
    dist, version = _version("fla")
    spec_found = importlib.util.find_spec("fla") is not None
    if version is None and not spec_found:
        return KernelStatus("fla", dist, None, False, "not installed")
    function, error = _import(*FLA_FUNCTION)
    if function is None:
        return KernelStatus("fla", dist, version, False, f"installed but does not import: {error}")
    if version is None:
        version = getattr(importlib.import_module("fla"), "__version__", None)
    if version is None or _parse(version) < _parse(MIN_FLA):
        why = f"older than {MIN_FLA}: fp32 inputs or more value than key heads unsupported; pip install -U flash-linear-attention"
        return KernelStatus("fla", dist, version, False, why)
    problem = _fla_backward_problem(version)
    if problem is not None:
        return KernelStatus("fla", dist, version, False, problem)
    return KernelStatus("fla", dist, version, True, f"chunk_gated_delta_rule, min {MIN_FLA}", function)


def _fla_backward_problem(version: str) -> str | None:
    """Why FLA's backward would raise on this GPU, or None.

    FLA 0.5.x raises in the backward of the gated chunk rule on Hopper with Triton >= 3.4
    (a Triton miscompilation, FLA issue #640) unless its TileLang backend takes over
    (`tilelang` installed, `nvcc` usable); from 0.5.2 Triton >= 3.7.1 is also fine
    (`TRITON_ABOVE_3_7_1`; 0.5.0 raises whatever the Triton). Asked of FLA's own flags so
    the rule stays FLA's.
    """
    try:
        utils = importlib.import_module("fla.utils")
    except Exception:  # noqa: BLE001
        return None
    if not (getattr(utils, "IS_NVIDIA_HOPPER", False) and getattr(utils, "TRITON_ABOVE_3_4_0", False)):
        return None
    if getattr(utils, "TRITON_ABOVE_3_7_1", False):
        return None
    try:
        backend = importlib.import_module("fla.ops.common.backends.tilelang").TileLangBackend
        if backend.is_available() and backend.is_enabled():
            return None
    except Exception:  # noqa: BLE001 (no such backend in this FLA: the Triton path runs)
        pass
    try:
        triton_version = md.version("triton")
    except md.PackageNotFoundError:
        triton_version = "?"
    return (
        f"FLA {version}'s backward raises on Hopper with Triton {triton_version} (FLA issue #640) unless "
        "its TileLang backend runs: pip install tilelang (needs nvcc), or Triton >= 3.7.1 with FLA >= 0.5.2"
    )


@functools.cache
def conv_status() -> KernelStatus:
    """causal-conv1d's `causal_conv1d_fn`: installed, importable, takes `seq_idx`."""
    dist, version = _version("causal_conv1d")
    if version is None and importlib.util.find_spec("causal_conv1d") is None:
        return KernelStatus("causal_conv1d", dist, None, False, "not installed")
    function, error = _import(*CONV_FUNCTION)
    if function is None:
        return KernelStatus("causal_conv1d", dist, version, False, f"installed but does not import: {error}")
    try:
        takes_seq_idx = "seq_idx" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        takes_seq_idx = False
    if not takes_seq_idx:
        return KernelStatus("causal_conv1d", dist, version, False, "causal_conv1d_fn takes no seq_idx (too old); pip install -U causal-conv1d")
    return KernelStatus("causal_conv1d", dist, version, True, "causal_conv1d_fn with seq_idx", function)


def status(package: str) -> KernelStatus:
    """`fla_status()` or `conv_status()` by import name."""
    return {"fla": fla_status, "causal_conv1d": conv_status}[package]()


@functools.cache
def transformers_uses(package: str) -> bool | None:
    """Whether Transformers' Qwen3.5 module calls `package`'s kernel (decided at its import;
    see module doc), or None where its wrapper does not show it."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    fn = getattr(hf, TRANSFORMERS_FUNCTIONS[package])
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:  # through decorators, to the fallback's wrapper
        seen.add(id(fn))
        cells = dict(zip(getattr(fn, "__code__", None) and fn.__code__.co_freevars or (), fn.__closure__ or ()))
        if "is_new_implementation" in cells:
            return bool(cells["is_new_implementation"].cell_contents)
        fn = getattr(fn, "__wrapped__", None)
    return None


def varlen_ok(package: str) -> bool:
    """Whether packed rows may go through Transformers' function with `cu_seqlens` /
    `seq_idx` (on CUDA tensors): the package is usable and Transformers calls it."""
    return status(package).usable and transformers_uses(package) is True


def avoid_transformers_kernel(package: str) -> bool:
    """Whether Transformers calls `package`'s kernel although it is not usable here
    (too old, or its backward would raise): then call the torch kernel instead."""
    return transformers_uses(package) is True and not status(package).usable


_warned: set[str] = set()


def warn_torch_fallback(what: str) -> None:
    """Warn once per process (per `what`) that a CUDA run takes a torch kernel, and why."""
    if what in _warned:
        return
    _warned.add(what)
    package = "fla" if what == "gated_delta" else "causal_conv1d"
    logger.warning(
        "qwen35_accel: the %s runs in plain torch on CUDA (much slower, same result): %s",
        "chunked gated delta rule" if package == "fla" else "causal conv",
        status(package).line(),
    )


def describe(cuda: bool) -> list[str]:
    """What `env` says: which kernels a run on this machine takes, and what each probe found."""
    lines = [] if cuda else ["CPU run: the torch kernels run (FLA's and causal-conv1d's kernels are CUDA-only); on CUDA:"]
    for package, kernel in (("fla", "GatedDeltaNet rule"), ("causal_conv1d", "GatedDeltaNet conv")):
        found = status(package)
        chosen = f"the {found.distribution} kernel" if found.usable else "torch (slow)"
        lines.append(f"{'  ' if not cuda else ''}{kernel}: {chosen} — {found.line()}")
        if avoid_transformers_kernel(package):
            lines.append(f"    (Transformers calls {found.distribution} here; qwen35_accel's layers take torch instead)")
    return lines


def run_summary(cuda: bool) -> str:
    """The kernels a run takes, in a few words (the plugin's prepared line); on CUDA, warns
    once for each kernel that falls back to torch (`warn_torch_fallback`)."""
    if not cuda:
        return "torch (CPU run; FLA's and causal-conv1d's kernels are CUDA-only)"
    parts = []
    for package, what, kernel in (("fla", "gated_delta", "rule"), ("causal_conv1d", "causal_conv", "conv")):
        found = status(package)
        if found.usable:
            parts.append(f"{kernel} {found.distribution} {found.version}")
        else:
            parts.append(f"{kernel} torch ({found.distribution}: {found.reason})")
            warn_torch_fallback(what)
    return ", ".join(parts)


def reset() -> None:
    """Forget every probe's result (tests that put fake packages on sys.path)."""
    fla_status.cache_clear()
    conv_status.cache_clear()
    transformers_uses.cache_clear()
    _warned.clear()
