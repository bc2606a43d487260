"""The depthwise causal conv of GatedDeltaNet as one kernel interface: causal-conv1d's, FLA's
Triton conv (where causal-conv1d is not usable: it needs a CUDA build, FLA installs with pip) or torch's.

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


def seq_idx_to_cu_seqlens(seq_idx: torch.Tensor) -> torch.Tensor:
    """`seq_idx` [batch, n] (non-decreasing along each row, as packed documents give) -> FLA's
    `cu_seqlens` [segments + 1] int32 over the flattened batch·n tokens: a segment starts at each
    row's start and wherever the index changes. One host sync (the segment count)."""
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    offsets = torch.nonzero(starts.flatten()).flatten()
    return torch.cat([offsets, offsets.new_tensor([seq_idx.numel()])]).to(torch.int32)


def fla_conv_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor:
    """The interface's rule through FLA's Triton `causal_conv1d` (`kernels.fla_conv_status()`
    usable; CUDA tensors, or CPU ones under Triton's interpreter in tests).

    FLA takes channel-last [batch, n, channels] and packed documents as `cu_seqlens` over one
    flattened row: `seq_idx` (non-decreasing per row) becomes those segments (one host sync).
    A caller that has the segments already passes `cu_seqlens` instead ([segments + 1] int32
    offsets over the flattened batch·n tokens, ending at batch·n, as Transformers' `cu_seq_lens_q`
    of packed rows): no sync. It accumulates in fp32 and returns `x`'s dtype. Further keyword
    arguments (Transformers' call passes its kwargs on) are ignored, as Transformers' wrapper
    filters them.
    """
    function = kernels.fla_conv_status().function
    assert function is not None, "fla_conv_kernel called without a usable FLA conv"
    if seq_idx is not None and cu_seqlens is not None:
        raise ValueError("fla_conv_kernel takes packed documents as seq_idx or as cu_seqlens, not both")
    batch, channels, n = x.shape
    channel_last = x.transpose(1, 2)
    if seq_idx is None and cu_seqlens is None:
        out, _ = function(channel_last, weight, bias, activation=activation)
    else:
        segments = seq_idx_to_cu_seqlens(seq_idx) if cu_seqlens is None else cu_seqlens.to(torch.int32)
        flat = channel_last.reshape(1, batch * n, channels)
        out, _ = function(flat, weight, bias, activation=activation, cu_seqlens=segments)
        out = out.view(batch, n, channels)
    return out.transpose(1, 2).to(x.dtype)


def causal_conv1d_kernel() -> ConvKernel | None:
    """causal-conv1d's `causal_conv1d_fn` (CUDA tensors only) where `kernels.conv_status()`
    finds it usable (installed, importable, takes `seq_idx`), else None."""
    return kernels.conv_status().function


def select_conv_kernel(device: torch.device) -> ConvKernel:
    """For tensors on `device` (`kernels.conv_package`): causal-conv1d's kernel on CUDA when
    usable, else FLA's Triton conv (`fla_conv_kernel`) when usable, else `torch_conv_kernel`
    (on CUDA with a warning, once per process, naming why).

    The causal-conv1d branch is not verified in this project's CI (no GPU there); FLA's conv
    is, through Triton's interpreter on CPU (`qwen35_accel.testing.interpreted_kernels`);
    `benchmarks/cuda_check.py` compares them on a GPU.
    """
    package = kernels.conv_package(device)
    if package == "causal_conv1d":
        return causal_conv1d_kernel()
    if package == "fla_conv":
        return fla_conv_kernel
    if device.type == "cuda":
        kernels.warn_torch_fallback("causal_conv")
    return torch_conv_kernel
