"""The parity helpers can fail: AdamW's derived weight bound admits reduction-order noise only."""

from __future__ import annotations

import pytest
import torch

from _parity import AdamWeightTolerance


def _two_adamw_runs(steps: int, lr_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, AdamWeightTolerance]:
    """Two AdamW runs of one weight from the same start; gradients from 1e-10 (noise level) to 1,
    one run's carrying relative noise 1e-6 plus absolute 1e-12; its lr times `lr_factor` at the last step."""
    generator = torch.Generator().manual_seed(0)
    start = 0.02 * torch.randn(1000, generator=generator)  # weights of the tiny models' size
    a, b = start.clone().requires_grad_(), start.clone().requires_grad_()
    opt_a, opt_b = torch.optim.AdamW([a], lr=1e-2), torch.optim.AdamW([b], lr=1e-2)
    tolerance = AdamWeightTolerance(lr=1e-2)
    for step in range(steps):
        grad = torch.randn(1000, generator=generator) * torch.logspace(-10, 0, 1000)
        a.grad = grad * (1 + 1e-6 * torch.randn(1000, generator=generator)) + 1e-12 * torch.randn(1000, generator=generator)
        b.grad = grad
        if step == steps - 1:
            opt_a.param_groups[0]["lr"] *= lr_factor
        tolerance.step("w", a.grad, b.grad)
        opt_a.step()
        opt_b.step()
    return a, b, tolerance


def test_adam_weight_tolerance_admits_gradient_noise_even_where_gradients_are_noise():
    a, b, tolerance = _two_adamw_runs(5)
    # Where gradients are noise, the runs' weights part beyond fp32 rtol 1e-5 / atol 1e-6 ...
    assert not torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # ... and stay within the bound derived from the gradients.
    tolerance.assert_close(a, b, "w", "noise only")


def test_adam_weight_tolerance_catches_an_update_one_percent_off():
    a, b, tolerance = _two_adamw_runs(5, lr_factor=1.01)
    with pytest.raises(AssertionError, match=r"w: \d+ of 1000 elements beyond AdamW's bound"):
        tolerance.assert_close(a, b, "w", "w")
