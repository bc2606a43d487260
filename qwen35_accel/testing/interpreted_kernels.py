"""FLA's Triton kernels on CPU tensors through Triton's interpreter (tests only).

The product's FLA branches (the CP chunk summaries, packed rows through `cu_seqlens`, the
non-CP GatedDeltaNet forward through Transformers' kernel functions, decoding with FLA's
recurrent kernel, FLA's Triton conv) are taken for CUDA tensors. Under Triton's interpreter
(`TRITON_INTERPRET=1`) the same kernels run on CPU tensors, as Python over NumPy, so CI
(no GPU) can test those branches against the torch kernels. `install()` makes that work:

- Triton's autotuner benchmarks its configs and the interpreter has no benchmarker ("0
  active drivers"): every FLA autotuner keeps its first config.
- Kernel bodies run as Python, so `for i_t in range(NT)` yields plain ints, and FLA calls
  `i_t.to(tl.int64)` on them: FLA's kernel modules get a `range` whose items are ints that
  answer `.to(dtype)` with a Triton scalar of that dtype.
- Transformers >= 5.25 sends inputs on devices it does not list for FLA (CPU) to its torch
  functions: its wrappers of FLA's functions get "cpu" among their devices, as a CUDA run's
  inputs pass them.
- `ops.kernels.TRITON_ON_CPU_VARIABLE` is set: kernel selection (`ops.kernels.takes_kernel`)
  then sends CPU tensors to FLA's Triton kernels exactly where it sends CUDA ones; no second
  code path in the product. Spawned ranks inherit it; each calls `install()` too.

`TRITON_INTERPRET=1` must be in the environment before `triton` is first imported (Triton
decides at each `@triton.jit` whether to interpret; Transformers imports FLA, and so Triton,
with its Qwen3.5 module): set it for the whole test process. `torch_oracle()` gives the
one-process oracle its torch kernels back while FLA is installed.
Importing this module imports nothing beyond the standard library.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any

# FLA's modules whose kernels this package's branches call (imported by `install`).
FLA_MODULES = ("fla.ops.gated_delta_rule", "fla.modules.convolution")
# Transformers' Qwen3.5 kernel functions that resolve to FLA when it imports (see `torch_oracle`).
TRANSFORMERS_FLA_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def unavailable() -> str | None:
    """Why the interpreted kernels cannot run in this process (a skip reason), or None:
    the packages (`pip install -e ".[kernels-cpu]"`) and `TRITON_INTERPRET=1` at start."""
    missing = [name for name in ("triton", "fla", "einops") if importlib.util.find_spec(name) is None]
    if missing:
        return f"{', '.join(missing)} not installed (pip install -e \".[kernels-cpu]\")"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET=1 is not set (run: TRITON_INTERPRET=1 python3 -m pytest -m kernels)"
    return None


def _index_type() -> type:
    import triton.language as tl

    class TritonIndex(int):
        """A loop index of an interpreted kernel: a plain int that also answers `.to(dtype)`
        as a Triton scalar does (FLA writes `i_t.to(tl.int64)` for 64-bit offsets)."""

        def to(self, dtype: Any, **_: Any) -> Any:
            return tl.full((), int(self), dtype)

    return TritonIndex


def _interpreted_range(index: type) -> Any:
    def interpreted_range(*args: int) -> Iterator[int]:
        return map(index, builtins.range(*args))

    return interpreted_range


def _kernel_chain(value: Any) -> Iterator[Any]:
    """`value` and what it wraps: Autotuner -> Heuristics -> InterpretedFunction (any order)."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.interpreter import InterpretedFunction

    while isinstance(value, (Autotuner, Heuristics, InterpretedFunction)):
        yield value
        value = getattr(value, "fn", None)


def install() -> dict[str, int]:
    """Make FLA's Triton kernels run on CPU tensors in this process (see module doc); idempotent.

    Returns how many autotuners were cut to one config and how many kernel modules got the
    interpreted `range` (for the record). Raises RuntimeError with the reason where
    `unavailable()` gives one, or where Triton was imported without its interpreter.
    """
    if (why := unavailable()) is not None:
        raise RuntimeError(f"FLA's kernels cannot run interpreted here: {why}")
    from triton import knobs
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import InterpretedFunction

    from ..ops import kernels

    if not knobs.runtime.interpret:
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: FLA's kernels are compiled ones")
    for module in FLA_MODULES:
        importlib.import_module(module)
    index = _index_type()
    interpreted_range = _interpreted_range(index)
    autotuners = kernel_modules = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            for link in _kernel_chain(value):
                if isinstance(link, Autotuner) and len(link.configs) > 1:
                    link.configs = link.configs[:1]
                    autotuners += 1
                if isinstance(link, InterpretedFunction):
                    namespace = link.fn.__globals__
                    if getattr(namespace.get("range"), "__name__", None) != "interpreted_range":
                        namespace["range"] = interpreted_range
                        kernel_modules += 1
    _transformers_admits_cpu()
    os.environ[kernels.TRITON_ON_CPU_VARIABLE] = "1"
    return {"autotuners": autotuners, "kernel_modules": kernel_modules}


def _transformers_admits_cpu() -> None:
    """Add "cpu" to the devices Transformers' wrappers of FLA's functions pass to FLA (>= 5.25
    keeps them in each wrapper's closure, `supported_devices`; before, it has none: FLA gets
    every device)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from ..ops import kernels

    for name in TRANSFORMERS_FLA_FUNCTIONS:
        for function in kernels.function_layers(getattr(hf, name)):
            devices = kernels.closure_cells(function).get("supported_devices")
            if devices is not None and devices.cell_contents is not None and "cpu" not in devices.cell_contents:
                devices.cell_contents = (*devices.cell_contents, "cpu")


@contextlib.contextmanager
def torch_oracle() -> Iterator[None]:
    """Transformers' Qwen3.5 kernel functions as they are without FLA installed (the torch
    functions under Transformers' wrappers), for the one-process oracle; restored on exit.

    Only the unmodified Transformers model's forward reads them inside; our CP layers call
    FLA directly (`ops.gated_delta.select_kernel`), our non-CP layers through these names:
    keep those outside the block.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from ..ops import kernels

    kernels.transformers_uses("fla")  # read (and cached) from Transformers' own wrappers first
    saved = {name: getattr(hf, name) for name in TRANSFORMERS_FLA_FUNCTIONS}
    try:
        for name, function in saved.items():
            setattr(hf, name, kernels.unwrap_function(function))
        yield
    finally:
        for name, function in saved.items():
            setattr(hf, name, function)


@contextlib.contextmanager
def launches() -> Iterator[list[str]]:
    """Record the name of every interpreted Triton kernel launched in the block, in order (a
    test's proof that a branch reached FLA's kernels); restored on exit."""
    from triton.runtime.interpreter import InterpretedFunction

    names: list[str] = []
    run = InterpretedFunction.run

    def recording_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield names
    finally:
        InterpretedFunction.run = run
