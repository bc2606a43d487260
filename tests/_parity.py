"""Helpers to compare a parallel model with the single-process Transformers model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# fp32: a parallel run sums the same terms in another order (ranks, chunks, tp slices).
RTOL, ATOL = 1e-5, 1e-6


def hf_name(name: str) -> str:
    """Parameter name in the parallel model -> name in the unmodified model."""
    return name.replace("._fp32_params.", ".")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def eval_logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of a forward without autograd: a parallelized model's training forwards
    (labels, grad enabled) compute the tiled loss and return no logits."""
    with torch.no_grad():
        return model(**inputs).logits


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


# One AdamW step moves an element by at most lr * (1 - beta1) / sqrt(1 - beta2) (Kingma & Ba,
# section 2.1; 3.16 lr at the default betas), whatever the gradient's size.
ADAM_STEP_BOUND = 0.1 / 0.001**0.5


def assert_close_after_adam(actual: torch.Tensor, expected: torch.Tensor, what: str, *, lr: float, steps: int) -> None:
    """A weight after `steps` AdamW steps (default betas) equals the reference's.

    Adam's update lr * m / (sqrt(v) + eps) has the size of lr for any gradient above eps,
    so an element whose gradient is reduction-order noise (|dL/dA_log| ~ 1e-10 for heads
    that forget within a token) moves by up to Adam's step bound in a direction the
    rounding decides, on any CPU. So: every element within the bound of both runs'
    steps (2 * steps * ADAM_STEP_BOUND * lr), and at most one element in a thousand (at
    least one) beyond fp32 rtol 1e-5 / atol 1e-6: a wrong gradient moves most of a
    tensor, noise moves single elements.
    """
    bound = 2 * steps * ADAM_STEP_BOUND * lr
    actual, expected = full(actual.detach()).float(), expected.detach().float()
    difference = (actual - expected).abs()
    assert difference.max() <= bound, f"{what}: {difference.max():.3g} beyond Adam's bound {bound:.3g}"
    off = difference > ATOL + RTOL * expected.abs()
    allowed = max(1, expected.numel() // 1000)
    assert off.sum() <= allowed, (
        f"{what}: {int(off.sum())} of {expected.numel()} elements beyond rtol {RTOL} / atol {ATOL} "
        f"(largest {difference.max():.3g}); noise in near-zero gradients explains at most {allowed}"
    )


def assert_params_match_after_adam(model: nn.Module, reference: nn.Module, *, lr: float, steps: int) -> None:
    """Every parameter, gathered, by `assert_close_after_adam`."""
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close_after_adam(p, ref[hf_name(name)], f"param {name}", lr=lr, steps=steps)


# Logged values that are not results of the run: wall clock, and the Trainer's FLOP estimate
# (tokens × parameters as each rank holds them, summed over the ranks: differs under cp and tp).
NOT_RESULTS = ("_runtime", "_per_second", "total_flos")
# Logged counts and positions: equal, not close.
COUNTS = ("step", "epoch", "learning_rate", "num_tokens", "eval_num_tokens", "num_input_tokens_seen")


def log_history(out: Path) -> list[dict[str, float]]:
    """The Trainer's per-step logs (`trainer_state.json` in the output directory `out`)."""
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def assert_same_log_history(got_dir: Path, want_dir: Path, rtol: float, atol: float = 0.0, extra_tokens: int = 0) -> None:
    """Every entry and value the Trainer (and TRL) logged for `got_dir`'s run equals
    `want_dir`'s (one process on the same global batch): counts exactly, means at
    `rtol`/`atol`. `extra_tokens`: per step, how many tokens a token count may exceed the
    reference by (a count that includes padding the reference does not have)."""
    got, want = log_history(got_dir), log_history(want_dir)
    assert [sorted(e) for e in got] == [sorted(e) for e in want], "different log entries"
    for g, w in zip(got, want):
        for key, expected in w.items():
            where = f"step {w['step']} {key}: got {g[key]}, one process {expected}"
            if any(part in key for part in NOT_RESULTS):
                continue
            if key in COUNTS and extra_tokens and key.endswith("num_tokens"):
                assert 0 <= g[key] - expected <= extra_tokens * w["step"], where
            elif key in COUNTS:
                assert g[key] == expected, where
            else:
                torch.testing.assert_close(g[key], expected, rtol=rtol, atol=atol, msg=where)
