"""Helpers to compare a parallel model with the single-process Transformers model."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

RTOL, ATOL = 1e-5, 1e-6


def hf_name(name: str) -> str:
    """Parameter name in the parallel model -> name in the unmodified model."""
    return name.replace("._fp32_params.", ".")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_grads_match(model: nn.Module, reference: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> int:
    """Every trainable parameter's gathered gradient equals the reference's. Returns the count."""
    ref = dict(reference.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        r = ref[hf_name(name)]
        if not p.requires_grad:
            assert p.grad is None, name
            continue
        assert p.grad is not None and r.grad is not None, f"{name}: missing gradient"
        assert_close(full(p.grad), r.grad, f"grad of {name}", rtol, atol)
        checked += 1
    assert checked > 0
    return checked


def assert_params_match(model: nn.Module, reference: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(full(p.detach()), ref[hf_name(name)].detach(), f"param {name}", rtol, atol)
