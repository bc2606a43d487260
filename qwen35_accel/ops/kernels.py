"""Which optional CUDA kernels this process can use, decided once: FLA's chunked gated delta
rule (package `flash-linear-attention`, module `fla`), causal-conv1d's conv and FLA's Triton
conv (`fla_conv`, taken where causal-conv1d is not usable).

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

The kernels run on CUDA tensors only (`takes_kernel`); on CPU the torch kernels run whatever
is installed. Tests run FLA's Triton kernels on CPU tensors through Triton's interpreter
(`qwen35_accel.testing.interpreted_kernels`), through this same selection.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata as md
import importlib.util
import inspect
import logging
import os
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
# FLA's Triton causal conv: `fla.modules.convolution.causal_conv1d(x [batch, seq, channels], weight
# [channels, taps], bias, activation=, cu_seqlens=) -> (y, final state)`, the same in 0.5.0 (module
# `fla.modules.convolution`) and 0.6.x (an alias of `fla.modules.causal_conv1d` kept there).
FLA_CONV_FUNCTION = ("fla.modules.convolution", "causal_conv1d")
# Packages whose kernels are Triton (they run on CPU tensors under Triton's interpreter; causal-conv1d
# is a CUDA build).
TRITON_PACKAGES = frozenset({"fla", "fla_conv"})
# Tests only: with this set to 1 (and Triton interpreting: TRITON_INTERPRET=1), CPU tensors take the
# Triton packages' kernels as CUDA tensors do (`takes_kernel`).
TRITON_ON_CPU_VARIABLE = "QWEN35_ACCEL_TRITON_ON_CPU"
# Where the version comes from, first found: from 0.3.2 on the `fla` ops ship in fla-core (which
# flash-linear-attention requires); before, in flash-linear-attention itself.
DISTRIBUTIONS = {
    "fla": ("fla-core", "flash-linear-attention"),
    "fla_conv": ("fla-core", "flash-linear-attention"),
    "causal_conv1d": ("causal-conv1d",),
}
# The Transformers function that names each package's kernel (see module doc).
TRANSFORMERS_FUNCTIONS = {"fla": "torch_chunk_gated_delta_rule", "causal_conv1d": "causal_conv1d_fn"}


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """What a probe of one package found. `usable`: we call its kernel on CUDA tensors."""

    package: str  # "fla", "causal_conv1d" (import names) or "fla_conv" (FLA's conv)
    distribution: str  # what `pip install` takes
    version: str | None  # installed distribution's version (None: not installed)
    usable: bool
    reason: str  # why not usable, or what is used
    function: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    def line(self) -> str:
        """One line for `env` and the prepared line: package, version, verdict."""
        version = self.version or "not installed"
        return f"{self.distribution} {version}: {'used on CUDA' if self.usable else 'NOT used'} ({self.reason})"


def takes_kernel(package: str, device: Any) -> bool:
    """Whether tensors on `device` (a `torch.device`) may go to `package`'s kernel: CUDA ones;
    CPU ones only for the Triton packages (`TRITON_PACKAGES`) in tests that run them through
    Triton's interpreter (`TRITON_ON_CPU_VARIABLE`=1 with `TRITON_INTERPRET=1`; without the
    latter this raises: compiled Triton kernels cannot take CPU tensors)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu" or package not in TRITON_PACKAGES or os.environ.get(TRITON_ON_CPU_VARIABLE) != "1":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{TRITON_ON_CPU_VARIABLE}=1 sends CPU tensors to FLA's Triton kernels, which only Triton's interpreter "
            "runs: set TRITON_INTERPRET=1 before triton is first imported (see qwen35_accel.testing.interpreted_kernels)"
        )
    return True


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


@functools.cache
def fla_conv_status() -> KernelStatus:
    """FLA's Triton causal conv: FLA installed, importable, >= MIN_FLA, with `cu_seqlens`."""
    dist, version = _version("fla_conv")
    if version is None and importlib.util.find_spec("fla") is None:
        return KernelStatus("fla_conv", dist, None, False, "not installed")
    function, error = _import(*FLA_CONV_FUNCTION)
    if function is None:
        return KernelStatus("fla_conv", dist, version, False, f"installed but its conv does not import: {error}")
    if version is None:
        version = getattr(importlib.import_module("fla"), "__version__", None)
    if version is None or _parse(version) < _parse(MIN_FLA):
        return KernelStatus("fla_conv", dist, version, False, f"older than {MIN_FLA}; pip install -U flash-linear-attention")
    try:
        takes_cu_seqlens = "cu_seqlens" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        takes_cu_seqlens = False
    if not takes_cu_seqlens:
        return KernelStatus("fla_conv", dist, version, False, "its causal_conv1d takes no cu_seqlens")
    return KernelStatus("fla_conv", dist, version, True, "FLA's Triton causal_conv1d with cu_seqlens", function)


def status(package: str) -> KernelStatus:
    """`fla_status()`, `conv_status()` or `fla_conv_status()` by name ("fla", "causal_conv1d", "fla_conv")."""
    return {"fla": fla_status, "causal_conv1d": conv_status, "fla_conv": fla_conv_status}[package]()


def conv_package(device: Any) -> str | None:
    """Which package's conv kernel tensors on `device` take: "causal_conv1d" where usable (CUDA),
    else "fla_conv" (FLA's Triton conv) where usable, else None (torch)."""
    return _chosen("conv", device)


def closure_cells(fn: Any) -> dict[str, Any]:
    """The closure cells of a plain function by free-variable name (empty for anything else)."""
    code = getattr(fn, "__code__", None)
    return dict(zip(code.co_freevars, fn.__closure__ or ())) if code is not None else {}


def function_layers(fn: Any) -> list[Any]:
    """`fn` and every callable it wraps, outermost first, the innermost last: `functools.wraps`'
    `__wrapped__`, and the function inside a `kernels` function module. With `kernels` installed
    (0.19), Transformers' Hub decorator turns a module-level function into an `nn.Module` instance
    whose class's `forward` calls the decorated function (closure cell `func`); without it the
    name holds the decorated function itself."""
    layers: list[Any] = []
    while fn is not None and all(fn is not seen for seen in layers):
        layers.append(fn)
        inner = getattr(fn, "__wrapped__", None)
        if inner is None and not hasattr(fn, "__code__"):  # a kernels function module
            cell = closure_cells(getattr(type(fn), "forward", None)).get("func")
            inner = None if cell is None else cell.cell_contents
        fn = inner
    return layers


def unwrap_function(fn: Any) -> Any:
    """The innermost callable under `fn` (`function_layers`): for Transformers' kernel functions,
    the torch function under its wrappers, whether `kernels` is installed or not."""
    return function_layers(fn)[-1]


@functools.cache
def transformers_uses(package: str) -> bool | None:
    """Whether Transformers' Qwen3.5 module calls `package`'s kernel (decided at its import;
    see module doc), or None where its wrapper does not show it."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    for fn in function_layers(getattr(hf, TRANSFORMERS_FUNCTIONS[package])):  # to the fallback's wrapper
        cell = closure_cells(fn).get("is_new_implementation")
        if cell is not None:
            return bool(cell.cell_contents)
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

# What each kernel slot can take, in order of preference (the torch kernel after them).
SLOTS = {"rule": ("fla",), "conv": ("causal_conv1d", "fla_conv")}
_SLOT_NAMES = {"rule": "chunked gated delta rule", "conv": "causal conv"}
KERNEL_NAMES = {"fla": "FLA's chunk_gated_delta_rule", "causal_conv1d": "causal-conv1d", "fla_conv": "FLA's Triton conv"}


def _why_torch(slot: str) -> str:
    return "; ".join(f"{status(p).distribution}{' conv' if p == 'fla_conv' else ''}: {status(p).reason}" for p in SLOTS[slot])


def warn_torch_fallback(what: str) -> None:
    """Warn once per process (per `what`: "gated_delta" or "causal_conv") that a CUDA run takes
    a torch kernel, and why (each candidate package's verdict)."""
    if what in _warned:
        return
    _warned.add(what)
    slot = "rule" if what == "gated_delta" else "conv"
    logger.warning("qwen35_accel: the %s runs in plain torch on CUDA (much slower, same result): %s", _SLOT_NAMES[slot], _why_torch(slot))


def _chosen(slot: str, device: Any) -> str | None:
    """The package whose kernel tensors on `device` take for `slot`, or None (torch)."""
    return next((p for p in SLOTS[slot] if takes_kernel(p, device) and status(p).usable), None)


def describe(cuda: bool) -> list[str]:
    """What `env` says: which kernels a run on this machine takes, and what each probe found."""
    import torch

    device = torch.device("cuda" if cuda else "cpu")
    lines = [] if cuda else ["CPU run: the torch kernels run (FLA's and causal-conv1d's kernels are CUDA-only); on CUDA:"]
    indent = "  " if not cuda else ""
    for slot, kernel in (("rule", "GatedDeltaNet rule"), ("conv", "GatedDeltaNet conv")):
        package = _chosen(slot, device) if cuda else next((p for p in SLOTS[slot] if status(p).usable), None)
        lines.append(f"{indent}{kernel}: {KERNEL_NAMES[package] if package else 'torch (slow)'}")
        for candidate in SLOTS[slot]:
            lines.append(f"{indent}  {KERNEL_NAMES[candidate]} — {status(candidate).line()}")
            if candidate in TRANSFORMERS_FUNCTIONS and avoid_transformers_kernel(candidate):
                lines.append(f"{indent}    (Transformers calls {status(candidate).distribution} here; qwen35_accel's layers take torch instead)")
    return lines


def run_summary(device: Any) -> str:
    """The kernels a run on `device` (a `torch.device`) takes, in a few words (the plugin's
    prepared line); on CUDA, warns once for each kernel that falls back to torch."""
    if not any(takes_kernel(p, device) for slot in SLOTS.values() for p in slot):
        return "torch (CPU run; FLA's and causal-conv1d's kernels are CUDA-only)"
    parts = []
    for slot, what in (("rule", "gated_delta"), ("conv", "causal_conv")):
        package = _chosen(slot, device)
        if package is not None:
            found = status(package)
            name = f"{found.distribution} {found.version}" + (" (Triton conv)" if package == "fla_conv" else "")
            interpreted = " interpreted on CPU" if device.type == "cpu" else ""
            parts.append(f"{slot} {name}{interpreted}")
        else:
            parts.append(f"{slot} torch ({_why_torch(slot)})")
            if device.type == "cuda":
                warn_torch_fallback(what)
    return ", ".join(parts)


def reset() -> None:
    """Forget every probe's result (tests that put fake packages on sys.path)."""
    fla_status.cache_clear()
    conv_status.cache_clear()
    fla_conv_status.cache_clear()
    transformers_uses.cache_clear()
    _warned.clear()
