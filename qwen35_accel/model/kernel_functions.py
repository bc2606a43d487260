"""Which kernel function a GatedDeltaNet layer calls: Transformers' (its package's CUDA kernel or
its torch fallback), FLA's Triton conv, or the torch function under Transformers' wrapper.

The choice is read from Transformers' module and `ops.kernels` at call time (`kernel_source`, a
constant to torch.compile: tracing that introspection crashed dynamo), and a torch fallback is the
plain function under Transformers' wrapper.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ..ops import kernels
from ..ops.causal_conv import fla_conv_kernel


def varlen_kernel(package: str, x: torch.Tensor) -> bool:
    """Whether packed rows go to a varlen kernel: FLA's rule (`cu_seqlens`, through Transformers'
    function) or a conv kernel (`seq_idx`: Transformers' causal-conv1d function, or FLA's Triton
    conv where that is the chosen one, `kernels.conv_package`). The package must take `x`'s
    device (`kernels.takes_kernel`: CUDA), be usable and be what Transformers calls (its torch
    fallbacks raise on those arguments). Elsewhere every document runs alone (`per_document`)."""
    if package == "causal_conv1d" and kernels.conv_package(x.device) == "fla_conv":
        return True
    return kernels.takes_kernel(package, x.device) and kernels.varlen_ok(package)


def kernel_function(name: str, package: str, x: torch.Tensor) -> Callable[..., Any]:
    """Transformers' kernel function `name` as Transformers resolved it (`package`'s kernel,
    or its torch fallback), except where it resolved to `package` and that cannot serve `x`:
    off CUDA (the packages' kernels are CUDA-only, Transformers calls them on any device), or
    `package` found unusable by `ops.kernels` (older than `MIN_FLA`, its backward would raise).
    Then the torch function under it. The conv (`causal_conv1d_fn`) takes FLA's Triton conv
    instead of any torch function where that is usable (`kernels.conv_package`)."""
    source = kernel_source(name, package, str(x.device))
    if source == "transformers":
        return getattr(hf, name)
    if source == "fla_conv":
        return fla_conv_kernel
    # The plain torch function under Transformers' wrapper (with `kernels` 0.19 an nn.Module, `Func`,
    # calling the decorated function): the same computation, and nothing for torch.compile to look into.
    return torch_function(name)


@torch.compiler.assume_constant_result
def kernel_source(name: str, package: str, device: str) -> str:
    """Where `kernel_function` takes `name` from for tensors on `device`: "transformers" (what Transformers
    calls: the package's kernel, or a wrapper that does not show its choice), "fla_conv" or "torch".
    A constant to torch.compile, computed when traced and not traced: it reads the closure cells of
    Transformers' wrappers, on which dynamo failed ("Expected CellVariable, got
    UserDefinedObjectVariable in load_cell") when the layer's forward traced it."""
    decided = kernels.transformers_uses(package)
    on = torch.device(device)
    if decided is True and kernels.takes_kernel(package, on) and kernels.status(package).usable:
        return "transformers"
    if name == "causal_conv1d_fn" and kernels.conv_package(on) == "fla_conv":
        return "fla_conv"
    return "transformers" if decided is None else "torch"


_TORCH_FUNCTIONS: dict[str, Callable[..., Any]] = {}


def torch_function(name: str) -> Callable[..., Any]:
    """The torch function under Transformers' `name`, refusing packed-row arguments as
    Transformers' own fallback does (the function itself ignores them). Made once per name (a
    plain dict: torch.compile traces through it without the warning `functools.cache` gives)."""
    if name not in _TORCH_FUNCTIONS:
        _TORCH_FUNCTIONS[name] = _refusing_packed_rows(name, kernels.unwrap_function(getattr(hf, name)))
    return _TORCH_FUNCTIONS[name]


def _refusing_packed_rows(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def refusing_packed_rows(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"`{name}` runs in plain torch here, which cannot keep packed documents apart "
                             "(`cu_seqlens` / `seq_idx`); `qwen35-accel env` says why the CUDA kernel is not used")
        return function(*args, **kwargs)

    return refusing_packed_rows
