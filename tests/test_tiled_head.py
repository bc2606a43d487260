"""`linear_token_stats`: the lm_head and next-token statistics in tiles of tokens equal the
same quantities computed from the whole `[tokens, vocab]` logits, in one process and with
the lm_head split by vocab over a gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from qwen35_accel.parallel.tiled_head import LOSS_MODES, OPTIONAL_STATS, linear_cross_entropy_sum, linear_token_stats, token_tile_size
from _dist import run_world

N, H, V = 37, 16, 48  # 37 tokens: tiles of 8 leave a remainder


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    bias = torch.randn(V, generator=g) * 0.1
    targets = torch.randint(0, V, (N,), generator=g)
    # Ties: make the target the max in some rows and a later index equal to it in one (not top-1
    # then: the first index of the max wins), so is_top1 is tested on both sides.
    weight[targets[:4]] = hidden[:4] * 3
    return hidden, weight, bias, targets


def _reference(hidden, weight, bias, targets, temperature):
    z = F.linear(hidden, weight, bias).float() / temperature
    log_p = z.log_softmax(-1)
    p = log_p.exp()
    return {
        "log_probs": log_p.gather(1, targets[:, None]).squeeze(1),
        "entropy": -(p * log_p).sum(-1),
        "log_sum_sq_probs": (2 * log_p).logsumexp(-1),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == targets,
    }


def _loss(stats) -> torch.Tensor:
    # Both differentiable outputs with different weights, so each backward term is checked.
    return -stats["log_probs"].sum() + 0.3 * stats["entropy"].sum()


def _expected(temperature: float):
    hidden, weight, bias, targets = _problem()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref = _reference(*leaves, targets, temperature)
    _loss(ref).backward()
    return {k: v.detach() for k, v in ref.items()}, [t.grad for t in leaves]


# fp32 rtol 1e-5: tiles and vocab slices sum the same terms in another order.
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tile", [8, 64])
def test_tiled_stats_and_gradients_equal_whole_logits(tile, temperature):
    want, want_grads = _expected(temperature)
    hidden, weight, bias, targets = _problem()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    stats = linear_token_stats(*leaves, targets, temperature=temperature, outputs=OPTIONAL_STATS, tile=tile)._asdict()
    for name, value in want.items():
        if name == "is_top1":
            assert torch.equal(stats[name], value) and value[:4].any() and not value.all()
        else:
            torch.testing.assert_close(stats[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    _loss(stats).backward()
    for leaf, grad, name in zip(leaves, want_grads, ("hidden", "weight", "bias")):
        torch.testing.assert_close(leaf.grad, grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"grad {n}: {m}")


def _cross_entropy_reference():
    hidden, weight, bias, targets = _problem()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = F.cross_entropy(F.linear(*leaves).float(), targets, reduction="sum")
    (0.37 * loss).backward()  # a scale the upstream gradient must carry
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("tile", [8, 64])
def test_cross_entropy_sum_and_its_gradients_equal_whole_logits(tile, mode):
    want, want_grads = _cross_entropy_reference()
    hidden, weight, bias, targets = _problem()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = linear_cross_entropy_sum(*leaves, targets, tile=tile, mode=mode)
    torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
    (0.37 * loss).backward()
    for leaf, grad, name in zip(leaves, want_grads, ("hidden", "weight", "bias")):
        torch.testing.assert_close(leaf.grad, grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"grad {n}: {m}")


def test_only_requested_outputs_are_computed_and_backward_needs_no_entropy():
    hidden, weight, bias, targets = _problem()
    hidden.requires_grad_()
    stats = linear_token_stats(hidden, weight, bias, targets, tile=8)
    assert stats.entropy is None and stats.is_top1 is None
    (-stats.log_probs.sum()).backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    with pytest.raises(ValueError, match="unknown outputs"):
        linear_token_stats(hidden, weight, bias, targets, outputs=("logits",))


def test_tile_size_bounds_one_tiles_fp32_logits():
    assert token_tile_size(248_320) == 264  # 2**28 bytes / (4 * 248,320) = 270, multiple of 8
    assert token_tile_size(248_320 // 8) * 4 * (248_320 // 8) <= 2**28
    assert token_tile_size(10**9) == 8


def _vocab_parallel_worker(rank: int, world: int, temperature: float) -> None:
    torch.manual_seed(0)
    want, want_grads = _expected(temperature)
    hidden, weight, bias, targets = _problem()
    rows = slice(rank * V // world, (rank + 1) * V // world)
    leaves = [hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_(), bias[rows].clone().requires_grad_()]
    stats = linear_token_stats(
        *leaves, targets, group=dist.group.WORLD, temperature=temperature, outputs=OPTIONAL_STATS, tile=8
    )._asdict()
    for name, value in want.items():
        if name == "is_top1":
            assert torch.equal(stats[name], value), name
        else:
            torch.testing.assert_close(stats[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    _loss(stats).backward()
    for leaf, grad, name in zip(leaves, (want_grads[0], want_grads[1][rows], want_grads[2][rows]), ("hidden", "weight", "bias")):
        torch.testing.assert_close(leaf.grad, grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"rank {rank} grad {n}: {m}")


    want, want_grads = _cross_entropy_reference()
    for mode in LOSS_MODES:
        leaves = [hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_(), bias[rows].clone().requires_grad_()]
        loss = linear_cross_entropy_sum(*leaves, targets, group=dist.group.WORLD, tile=8, mode=mode)
        torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
        (0.37 * loss).backward()
        for leaf, grad, name in zip(leaves, (want_grads[0], want_grads[1][rows], want_grads[2][rows]), ("hidden", "weight", "bias")):
            torch.testing.assert_close(leaf.grad, grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"rank {rank} {mode} CE grad {n}: {m}")


@pytest.mark.multiprocess
def test_vocab_parallel_stats_and_gradients_equal_whole_logits():
    run_world(_vocab_parallel_worker, 2, 0.7)


def test_recompute_saves_only_the_hidden_states_as_given_the_targets_and_one_fp32_per_row():
    hidden, weight, bias, targets = _problem()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_cross_entropy_sum(*leaves, targets, tile=8, mode="recompute")
    for param in leaves[1:]:
        saved.pop(param.untyped_storage().data_ptr())
    assert saved.pop(leaves[0].untyped_storage().data_ptr()) == N * H * 4  # no copy of the hidden states
    assert saved.pop(targets.untyped_storage().data_ptr()) == N * 8
    assert list(saved.values()) == [N * 4]  # the log-sum-exp


def test_an_unknown_mode_is_refused():
    hidden, weight, bias, targets = _problem()
    with pytest.raises(ValueError, match="mode 'keep' is not one of"):
        linear_cross_entropy_sum(hidden, weight, bias, targets, mode="keep")


def _bf16_errors(fn, hidden, weight, targets, reference) -> list[float]:
    leaves = [hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()]
    (0.01 * fn(*leaves, targets)).backward()
    return [((leaf.grad.double() - want).norm() / want.norm()).item() for leaf, want in zip(leaves, reference)]


@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("slice_bytes", [2**26, 1000])
def test_bf16_gradients_are_as_close_to_fp64_as_transformers_bf16_loss(mode, slice_bytes, monkeypatch):
    """Under a bf16 compute dtype the tiled GEMMs run in bf16 (fp32 accumulation inside each,
    the weight's gradient summed over 64 tiles in fp32): the gradients' error against fp64 is
    within 1.5× that of Transformers' bf16 path (whole bf16 logits upcast). Summing the tiles
    in bf16 instead triples the weight's error. `slice_bytes` small: the weight's gradient is
    added in many row slices."""
    import qwen35_accel.parallel.tiled_head as tiled_head

    monkeypatch.setattr(tiled_head, "WEIGHT_GRAD_SLICE_BYTES", slice_bytes)
    g = torch.Generator().manual_seed(0)
    n, h, v = 512, 64, 1000
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / h**0.5
    targets = torch.randint(0, v, (n,), generator=g)
    leaves = [hidden.double().requires_grad_(), weight.double().requires_grad_()]
    (0.01 * F.cross_entropy(F.linear(*leaves), targets, reduction="sum")).backward()
    reference = [leaf.grad for leaf in leaves]
    stock = _bf16_errors(lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t, reduction="sum"),
                         hidden, weight, targets, reference)
    tiled = _bf16_errors(lambda x, w, t: linear_cross_entropy_sum(x, w, None, t, tile=8, mode=mode),
                         hidden, weight, targets, reference)
    for name, ours, theirs in zip(("hidden", "weight"), tiled, stock):
        assert ours <= 1.5 * theirs, f"{mode}: bf16 grad of {name} is {ours:.2e} from fp64; Transformers' bf16 loss {theirs:.2e}"


def test_hold_scales_its_gradients_in_place_so_a_second_backward_is_refused():
    """`hold` scales the gradients it holds in place in backward (no second weight-sized
    copy); a second backward through the same graph must fail loudly, not reuse them scaled."""
    hidden, weight, bias, targets = _problem()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = 0.37 * linear_cross_entropy_sum(*leaves, targets, tile=8, mode="hold")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
