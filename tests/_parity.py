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


def documents_alone(reference: nn.Module, documents: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of a packed row: the logits of each document ([1, length] ids) run alone,
    concatenated, and the packed loss: the sum of every document's next-token losses over the
    number of predictions."""
    logits, total, count = [], 0.0, 0
    for doc in documents:
        out = reference(input_ids=doc).logits
        logits.append(out)
        total = total + torch.nn.functional.cross_entropy(out[0, :-1], doc[0, 1:], reduction="sum")
        count += doc.shape[1] - 1
    return torch.cat(logits, dim=1), total / count


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


class AdamWeightTolerance:
    """How far two AdamW runs' weights may drift apart, element-wise, derived from both runs' gradients.

    AdamW moves a weight by lr * u, u = m_hat / (sqrt(v_hat) + eps), so a gradient difference
    d (here: the parallel run's reduction order) changes u by at most
    (|d|_m + |u_ref| * |d|_v) / (sqrt(v_hat) + eps), where |d|_m and |d|_v are d's magnitudes
    through Adam's two moving averages and v_hat is the parallel run's (triangle inequality;
    exact, not first order). An
    element whose gradient is well above its noise may move by lr * (relative noise); one
    whose gradient is noise (|dL/dA_log| ~ 1e-10 for heads that forget within a token) may
    move by its whole step, |u_ref| + |u|: the rounding decides its direction on any CPU.
    Weight decay shrinks an earlier difference by (1 - lr * weight_decay) per step.

    Feed `step` with each parameter's gathered gradients, the ones the optimizers are about
    to use, at every step; then `assert_close` the weights. Default betas and eps, no amsgrad.
    """

    def __init__(self, *, lr: float, weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, start: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """start: optimizer state both runs begin from (Transformers name -> exp_avg, exp_avg_sq, step)."""
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self._state = {name: self._begin(state["exp_avg"].float(), state["exp_avg_sq"].float(), float(state["step"]))
                       for name, state in (start or {}).items()}

    @staticmethod
    def _begin(m: torch.Tensor, v: torch.Tensor, steps: float) -> dict[str, torch.Tensor]:
        """Both runs' moments (equal at the start), the noise through each moment, the weights' bound."""
        zero = torch.zeros_like(m)
        return dict(m_ref=m, m=m.clone(), v_ref=v, v=v.clone(), noise_m=zero, noise_v=zero.clone(), bound=zero.clone(),
                    steps=torch.tensor(steps))

    def step(self, name: str, grad: torch.Tensor, ref_grad: torch.Tensor) -> None:
        """One AdamW step of parameter `name` (Transformers name): the parallel run's gradient and the reference's."""
        beta1, beta2 = self.betas
        grad, ref_grad = full(grad.detach()).float(), ref_grad.detach().float()
        if name not in self._state:
            self._state[name] = self._begin(torch.zeros_like(ref_grad), torch.zeros_like(ref_grad), 0.0)
        s = self._state[name]
        noise = (grad - ref_grad).abs()
        for key, g in (("m_ref", ref_grad), ("m", grad), ("noise_m", noise)):
            s[key] = beta1 * s[key] + (1 - beta1) * g
        for key, g in (("v_ref", ref_grad), ("v", grad), ("noise_v", noise)):
            s[key] = beta2 * s[key] + (1 - beta2) * g * g
        s["steps"] += 1
        c1, c2 = 1 - beta1 ** s["steps"], 1 - beta2 ** s["steps"]
        u_ref = (s["m_ref"] / c1) / ((s["v_ref"] / c2).sqrt() + self.eps)
        u = (s["m"] / c1) / ((s["v"] / c2).sqrt() + self.eps)
        propagated = (s["noise_m"] / c1 + u_ref.abs() * (s["noise_v"] / c2).sqrt()) / ((s["v"] / c2).sqrt() + self.eps)
        du = torch.minimum(propagated, u_ref.abs() + u.abs())
        s["bound"] = (1 - self.lr * self.weight_decay) * s["bound"] + self.lr * du

    def step_model(self, model: nn.Module, reference: nn.Module) -> None:
        """`step` for every trainable parameter of `model` (plain or FSDP2) and its reference."""
        ref = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.step(hf_name(name), p.grad, ref[hf_name(name)].grad)

    def assert_close(self, actual: torch.Tensor, expected: torch.Tensor, name: str, what: str) -> None:
        """Weights of parameter `name` after the steps fed so far, within the derived bound."""
        actual, expected = full(actual.detach()).float(), expected.detach().float()
        # Plus fp32 rtol 1e-5 / atol 1e-6: each run rounds its own update arithmetic.
        tolerance = self._state[name]["bound"] + ATOL + RTOL * expected.abs()
        excess = (actual - expected).abs() - tolerance
        worst = int(excess.argmax())
        assert excess.max() <= 0, (
            f"{what}: {int((excess > 0).sum())} of {expected.numel()} elements beyond AdamW's bound from the gradients' "
            f"differences; worst at flat index {worst}: {actual.flatten()[worst]:.8g} vs {expected.flatten()[worst]:.8g}, "
            f"bound {tolerance.flatten()[worst]:.3g}"
        )


def assert_params_match_after_adam(model: nn.Module, reference: nn.Module, adam: AdamWeightTolerance) -> None:
    """Every parameter, gathered, within the bound `adam` derived from both runs' gradients."""
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        adam.assert_close(p, ref[hf_name(name)], hf_name(name), f"param {name}")


# Logged values that are not results of the run: wall clock, and the Trainer's FLOP estimate
# (6 × positions × parameters of each rank's batch, padding included, summed over the
# ranks: compared only where asked, see `assert_same_log_history`).
NOT_RESULTS = ("_runtime", "_per_second", "total_flos")
# Logged counts and positions: equal, not close.
COUNTS = ("step", "epoch", "learning_rate", "num_tokens", "eval_num_tokens", "num_input_tokens_seen")


# A logged share of comparisons flips on last-bit differences where the compared values tie: TRL's
# `rewards/accuracies` counts the rows whose chosen reward exceeds the rejected one, and while the
# policy equals its reference (a first step) every reward is 0 in one process, while cp 2 x tp 2 with
# precomputed reference log-probs logged +1.9e-7 / -9.5e-8 (accuracy 0.5 against 0.0). Where one process
# logged only tied rewards (chosen and rejected both exactly 0) the share is not compared; the rewards
# and margins are.
TIED_SHARES = {"rewards/accuracies": ("rewards/chosen", "rewards/rejected")}


def _tied_share(key: str, entry: dict[str, float]) -> bool:
    """Whether `key` of one process's log `entry` is a share of comparisons between tied values."""
    for share, compared in TIED_SHARES.items():
        if key.endswith(share):
            prefix = key[: -len(share)]  # eval_ as the Trainer logs evaluation
            return all(entry.get(prefix + name) == 0.0 for name in compared)
    return False


def log_history(out: Path) -> list[dict[str, float]]:
    """The Trainer's per-step logs (`trainer_state.json` in the output directory `out`)."""
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def assert_same_log_history(
    got_dir: Path, want_dir: Path, rtol: float, atol: float = 0.0, skip: tuple[str, ...] = (), flos: bool = False
) -> None:
    """Every entry and value the Trainer (and TRL) logged for `got_dir`'s run equals
    `want_dir`'s (one process on the same global batch): counts exactly, means at
    `rtol`/`atol`. `skip`: keys the two runs count differently by construction (left out
    of both). `flos`: also the Trainer's `total_flos` (the final train metrics and
    `trainer_state.json`), exactly; it counts padded positions, so ask only where every
    rank's batch shape adds up to one process's (no per-rank padding under dp). A share of
    comparisons between values one process logged as ties is left out (`TIED_SHARES`)."""
    got, want = (
        [{k: v for k, v in e.items() if k not in skip} for e in log_history(d)] for d in (got_dir, want_dir)
    )
    assert [sorted(e) for e in got] == [sorted(e) for e in want], "different log entries"
    for g, w in zip(got, want):
        for key, expected in w.items():
            where = f"step {w['step']} {key}: got {g[key]}, one process {expected}"
            if key == "total_flos" and flos:
                assert g[key] == expected, where
            elif any(part in key for part in NOT_RESULTS):
                continue
            elif key in COUNTS:
                assert g[key] == expected, where
            elif _tied_share(key, w):
                continue
            else:
                torch.testing.assert_close(g[key], expected, rtol=rtol, atol=atol, msg=where)
    if flos:
        got_total, want_total = (json.loads((d / "trainer_state.json").read_text())["total_flos"] for d in (got_dir, want_dir))
        assert got_total == want_total, f"trainer_state.json total_flos: got {got_total}, one process {want_total}"
