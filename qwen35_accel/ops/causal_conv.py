"""The depthwise causal conv of GatedDeltaNet as one kernel interface: causal-conv1d's or torch's.

Both are called as causal-conv1d's `causal_conv1d_fn` is: kernel(x [batch, channels, n],
weight [channels, taps], bias [channels] | None, seq_idx=[batch, n] int32 | None,
activation=None | "silu") -> [batch, channels, n]. Output t sums weight taps over x[t − j]
(j < taps; zeros before the start); with `seq_idx` a tap counts only where
seq_idx[t − j] == seq_idx[t], so tokens with different indices never mix (packed documents).
causal-conv1d accepts `seq_idx` only for channel-last `x` (stride 1 along channels), the
layout GatedDeltaNet's `in_proj_qkv(h).transpose(1, 2)` has; callers keep it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from . import kernels

ConvKernel = Callable[..., torch.Tensor]


def torch_conv_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """The interface's rule in plain torch (any device; differentiable): see the module doc.

    Computes in `weight`'s dtype and returns `x`'s dtype, as Transformers' fallback does.
    """
    taps, n = weight.shape[-1], x.shape[-1]
    xw = x.to(weight.dtype)
    if seq_idx is None:
        out = F.conv1d(xw, weight.unsqueeze(1), bias, padding=taps - 1, groups=x.shape[1])[..., :n]
    else:
        padded = F.pad(xw, (taps - 1, 0))
        # Index −1 for the zero padding: it never equals a token's index, and it is zero anyway.
        index = F.pad(seq_idx, (taps - 1, 0), value=-1)
        out = torch.zeros_like(xw) if bias is None else bias[None, :, None].expand_as(xw)
        for back in range(taps):
            start = taps - 1 - back
            same = (index[:, start : start + n] == seq_idx)[:, None, :].to(xw.dtype)
            out = out + weight[None, :, start, None] * padded[..., start : start + n] * same
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


def causal_conv1d_kernel() -> ConvKernel | None:
    """causal-conv1d's `causal_conv1d_fn` (CUDA tensors only) where `kernels.conv_status()`
    finds it usable (installed, importable, takes `seq_idx`), else None."""
    return kernels.conv_status().function


def select_conv_kernel(device: torch.device) -> ConvKernel:
    """causal-conv1d's kernel on CUDA when usable, else `torch_conv_kernel` (on CUDA with a
    warning, once per process, naming why).

    The causal-conv1d branch is not verified in this project's CI (no GPU there);
    `benchmarks/cuda_check.py` compares the two on a GPU.
    """
    if device.type == "cuda":
        if (kernel := causal_conv1d_kernel()) is not None:
            return kernel
        kernels.warn_torch_fallback("causal_conv")
    return torch_conv_kernel
