"""`linear_token_stats`: the lm_head and next-token statistics in tiles of tokens equal the
same quantities computed from the whole `[tokens, vocab]` logits, in one process and with
the lm_head split by vocab over a gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from qwen35_accel.parallel.tiled_head import LOSS_MODES, OPTIONAL_STATS, block_shape, linear_cross_entropy_sum, linear_token_stats
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


# fp32 rtol 1e-5: blocks and vocab slices sum the same terms in another order.
RTOL, ATOL = 1e-5, 1e-6
# (tokens, vocab rows) per block: one block; token blocks with a remainder; token and vocab
# blocks, both with a remainder (48 rows: 20, 20, 8).
BLOCKS = [(64, None), (8, None), (8, 20)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tile, vocab_tile", BLOCKS)
def test_tiled_stats_and_gradients_equal_whole_logits(tile, vocab_tile, temperature):
    want, want_grads = _expected(temperature)
    hidden, weight, bias, targets = _problem()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    stats = linear_token_stats(*leaves, targets, temperature=temperature, outputs=OPTIONAL_STATS, tile=tile,
                               vocab_tile=vocab_tile)._asdict()
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
@pytest.mark.parametrize("tile, vocab_tile", BLOCKS)
def test_cross_entropy_sum_and_its_gradients_equal_whole_logits(tile, vocab_tile, mode):
    want, want_grads = _cross_entropy_reference()
    hidden, weight, bias, targets = _problem()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = linear_cross_entropy_sum(*leaves, targets, tile=tile, vocab_tile=vocab_tile, mode=mode)
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


def test_a_block_holds_at_most_256_MiB_of_fp32_logits_and_up_to_4096_tokens():
    assert block_shape(264, 248_320) == (264, 248_320)  # 264 tokens fit the whole vocab in 2**28 bytes
    assert block_shape(32_768, 248_320) == (4096, 16_384)  # 2**28 / (4 * 4096) rows
    assert block_shape(37, 48) == (40, 48)  # a multiple of 8 tokens
    assert block_shape(8, 10**9) == (8, 8388608) and block_shape(10**6, 10**9)[1] == 16_384
    assert block_shape(100, 48, tile=8, vocab_tile=100) == (8, 48)


def _vocab_parallel_worker(rank: int, world: int, temperature: float) -> None:
    torch.manual_seed(0)
    want, want_grads = _expected(temperature)
    hidden, weight, bias, targets = _problem()
    rows = slice(rank * V // world, (rank + 1) * V // world)
    leaves = [hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_(), bias[rows].clone().requires_grad_()]
    stats = linear_token_stats(
        *leaves, targets, group=dist.group.WORLD, temperature=temperature, outputs=OPTIONAL_STATS, tile=8, vocab_tile=10
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
        loss = linear_cross_entropy_sum(*leaves, targets, group=dist.group.WORLD, tile=8, vocab_tile=10, mode=mode)
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
@pytest.mark.parametrize("tile, vocab_tile", [(8, None), (64, 128)])
def test_bf16_gradients_are_as_close_to_fp64_as_transformers_bf16_loss(mode, tile, vocab_tile):
    """Under a bf16 compute dtype the blocks' GEMMs run in bf16 (fp32 accumulation inside
    each; on CPU each product rounded to bf16 once, the sums over token blocks (the weight's)
    and vocab blocks (the hidden states') in fp32): the gradients' error against fp64 is
    within 1.5× that of Transformers' bf16 path (whole bf16 logits upcast). Summing the blocks
    in bf16 instead triples the weight's error."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 512, 64, 1000
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / h**0.5
    targets = torch.randint(0, v, (n,), generator=g)
    leaves = [hidden.double().requires_grad_(), weight.double().requires_grad_()]
    (0.01 * F.cross_entropy(F.linear(*leaves), targets, reduction="sum")).backward()
    reference = [leaf.grad for leaf in leaves]
    stock = _bf16_errors(lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t, reduction="sum"),
                         hidden, weight, targets, reference)
    tiled = _bf16_errors(lambda x, w, t: linear_cross_entropy_sum(x, w, None, t, tile=tile, vocab_tile=vocab_tile, mode=mode),
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


class _Made(TorchDispatchMode):
    """Every tensor an op makes (not a view or an in-place result): (op, numel, dtype); and
    the collectives called."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, int, torch.dtype]] = []
        self.collectives: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        given = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name.startswith("c10d::"):
            self.collectives.append(name)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.outputs.append((name, t.numel(), t.dtype))
        return out


# (hidden dtype, weight dtype, autocast dtype): a bf16 policy; TRL's `cast_lm_head_to_fp32`
# (fp32 hidden states, the bf16 weight, autocast off); fp32 masters under bf16 autocast.
DTYPES = [(torch.bfloat16, torch.bfloat16, None), (torch.float32, torch.bfloat16, None), (torch.float32, torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("head", ["recompute", "hold", "token_stats"])
@pytest.mark.parametrize("hidden_dtype, weight_dtype, autocast", DTYPES)
def test_nothing_of_the_weights_size_is_made_but_its_gradient(head, hidden_dtype, weight_dtype, autocast):
    """The lm_head weight is neither copied whole into the compute dtype (forward and again in
    backward, as `cast_lm_head_to_fp32` did: 5 GB at 27B) nor accumulated in a weight-sized
    fp32 tensor beside its gradient (5.09 + 2.54 GB alive together): in blocks of vocab rows.
    The one weight-sized tensor made is its gradient, in the weight's dtype."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 48, 64, 4096  # fewer tokens than hidden: a block's logits are smaller than the weight
    hidden = torch.randn(n, h, generator=g).to(hidden_dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(weight_dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    with _Made() as made, torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if head == "token_stats":
            loss = -linear_token_stats(hidden, weight, None, targets, outputs=("entropy",), vocab_tile=1024).log_probs.sum()
        else:
            loss = linear_cross_entropy_sum(hidden, weight, None, targets, vocab_tile=1024, mode=head)
        loss.backward()
    weight_sized = [(op, dtype) for op, numel, dtype in made.outputs if numel >= weight.numel()]
    assert weight_sized == [("aten::empty_like", weight_dtype)], weight_sized
    assert weight.grad.dtype == weight_dtype and torch.isfinite(weight.grad.float()).all()


def _collectives_worker(rank: int, world: int) -> None:
    """One all-gather per call in forward whatever the number of blocks (before: a max and a
    sum all-reduce per tile, about 1k latency-bound calls at 128k tokens under tp), one
    all-reduce of the hidden states' gradient where the gradients are computed."""
    hidden, weight, bias, targets = _problem()
    rows = slice(rank * V // world, (rank + 1) * V // world)
    for head in ("recompute", "hold", "token_stats"):
        leaves = [hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_(), bias[rows].clone().requires_grad_()]
        with _Made() as forward:  # 5 token blocks × 3 vocab blocks
            if head == "token_stats":
                out = -linear_token_stats(*leaves, targets, group=dist.group.WORLD, outputs=OPTIONAL_STATS, tile=8,
                                          vocab_tile=10).log_probs.sum()
            else:
                out = linear_cross_entropy_sum(*leaves, targets, group=dist.group.WORLD, tile=8, vocab_tile=10, mode=head)
        with _Made() as backward:
            out.backward()
        gradients_in_forward = head == "hold"
        assert len(forward.collectives) == 1 + gradients_in_forward, (head, forward.collectives)
        assert len(backward.collectives) == (not gradients_in_forward), (head, backward.collectives)


@pytest.mark.multiprocess
def test_vocab_parallel_heads_make_one_collective_per_call_and_pass():
    run_world(_collectives_worker, 2)


@pytest.mark.parametrize("head", ["recompute", "hold", "token_stats"])
def test_no_labelled_token_gives_zero_gradients_in_bf16(head):
    """A rank whose rows hold no label (all -100 in its chunks) passes zero tokens: the loss is
    0 and every gradient exactly 0, in bf16 too (where the weight's gradient is written block
    by block, not accumulated into zeros)."""
    hidden = torch.randn(0, H).bfloat16().requires_grad_()
    weight = torch.randn(V, H).bfloat16().requires_grad_()
    targets = torch.zeros(0, dtype=torch.long)
    if head == "token_stats":
        loss = -linear_token_stats(hidden, weight, None, targets, vocab_tile=20).log_probs.sum()
    else:
        loss = linear_cross_entropy_sum(hidden, weight, None, targets, vocab_tile=20, mode=head)
    loss.backward()
    assert loss.item() == 0 and hidden.grad.shape == (0, H)
    assert torch.equal(weight.grad, torch.zeros_like(weight))
