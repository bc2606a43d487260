"""Context-parallel GatedDeltaNet ops equal the single-process chunked rule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_chunk_gated_delta_rule

from _dist import run_world
from _parity import assert_close
from qwen35_accel.ops.gated_delta import chunk_summary, fold_states, read_state
from qwen35_accel.parallel.context_parallel.layout import (
    local_positions,
    pad_for_context_parallel,
    shard_sequence,
    unshard_sequence,
)

B, K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 2, 4, 8, 6  # GQA: 2 value heads per key head


def _inputs(seq: int, seed: int, requires_grad: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, seq, K_HEADS, K_DIM, generator=gen)
    k = torch.randn(B, seq, K_HEADS, K_DIM, generator=gen)
    v = torch.randn(B, seq, V_HEADS, V_DIM, generator=gen)
    # Weak decay (|g| ~ 0.002-0.05): the state carries across the whole sequence.
    g = -torch.empty(B, seq, V_HEADS).uniform_(0.002, 0.05, generator=gen)
    beta = torch.rand(B, seq, V_HEADS, generator=gen)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, g, beta)]


def _reference(q, k, v, g, beta, initial_state=None):
    return torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )


def test_chunk_summary_is_the_affine_map_of_the_incoming_state():
    q, k, v, g, beta = _inputs(100, seed=0)
    state = torch.randn(B, V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(1))
    out_ref, final_ref = _reference(q, k, v, g, beta, initial_state=state)
    o0, w, M, U = chunk_summary(q, k, v, g, beta)
    assert_close(read_state(o0, w, state), out_ref, "output")
    assert_close(M @ state + U, final_ref, "final state")


def test_folding_chunk_summaries_reproduces_the_whole_sequence():
    q, k, v, g, beta = _inputs(192, seed=2)
    out_ref, final_ref = _reference(q, k, v, g, beta)
    parts = [chunk_summary(*(t[:, i * 24 : (i + 1) * 24] for t in (q, k, v, g, beta))) for i in range(8)]
    states = fold_states([p[2] for p in parts], [p[3] for p in parts])
    out = torch.cat([read_state(o0, w, s) for (o0, w, _, _), s in zip(parts, states)], dim=1)
    assert_close(out, out_ref, "output")
    assert_close(states[-1], final_ref, "final state")


def test_layout_round_trip_and_balance():
    x = torch.arange(48).reshape(1, 48)
    for cp in (1, 2, 3, 4):
        parts = [shard_sequence(x, cp, r) for r in range(cp)]
        assert torch.equal(unshard_sequence(parts, cp), x)
        assert torch.equal(parts[0][0], local_positions(48, cp, 0))
    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2\*cp = 4.*pad_to_multiple_of=4"):
        local_positions(10, 2, 0)
    assert pad_for_context_parallel(torch.ones(1, 10, dtype=torch.long), 2, value=-100)[0, -2:].tolist() == [-100, -100]


def _cp_ops_worker(rank: int, cp: int, seqs: tuple[int, ...]) -> None:
    from qwen35_accel.parallel.context_parallel.gated_delta_net import cp_causal_conv1d, cp_gated_delta_rule

    group = dist.group.WORLD
    for seq in seqs:
        padded_seq = seq + (-seq) % (2 * cp)
        inputs = _inputs(seq, seed=seq, requires_grad=True)
        out_ref, _ = _reference(*inputs)
        weights = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7))
        (out_ref * weights).sum().backward()

        local = [
            shard_sequence(pad_for_context_parallel(t.detach(), cp), cp, rank).requires_grad_() for t in inputs
        ]
        out = cp_gated_delta_rule(*local, group=group)
        positions = local_positions(padded_seq, cp, rank)
        real = positions < seq  # padded tokens (right padding) are dropped
        assert_close(out[:, real], out_ref.detach()[:, positions[real]], f"output, cp {cp}, seq {seq}")
        local_weights = shard_sequence(pad_for_context_parallel(weights, cp), cp, rank)
        (out[:, real] * local_weights[:, real]).sum().backward()
        for name, t, t_local in zip(("q", "k", "v", "g", "beta"), inputs, local):
            # Gradients of g and beta are sums over a 64-token kernel chunk (and the head
            # dims) of terms as large as the tensor's largest entries (~5 here); CP moves
            # the chunk boundaries, so their rounding differs by ~eps·sqrt(64)·max|grad|.
            # atol therefore scales with max|grad|: 1e-6 for gradients of magnitude ≤ 1.
            # (A wrong state across chunks shows at ~1e-4 with this weak decay.)
            atol = 1e-6 * max(1.0, t.grad.abs().max().item())
            assert_close(t_local.grad[:, real], t.grad[:, positions[real]], f"d{name}, cp {cp}, seq {seq}", atol=atol)

        # The causal conv with its halo (kernel 4), in the same layout.
        channels = 5
        x = torch.randn(B, channels, padded_seq, generator=torch.Generator().manual_seed(seq)).requires_grad_()
        weight = torch.randn(channels, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()
        conv_ref = causal_conv1d_fn(x, weight, None, activation="silu")
        conv_w = torch.randn(conv_ref.shape, generator=torch.Generator().manual_seed(4))
        (conv_ref * conv_w).sum().backward()
        x_local = shard_sequence(x.detach(), cp, rank, seq_dim=2).requires_grad_()
        w_local = weight.detach().clone().requires_grad_()
        conv = cp_causal_conv1d(x_local, w_local, None, group=group, activation="silu")
        assert_close(conv, shard_sequence(conv_ref.detach(), cp, rank, seq_dim=2), f"conv, cp {cp}, seq {padded_seq}")
        (conv * shard_sequence(conv_w, cp, rank, seq_dim=2)).sum().backward()
        assert_close(x_local.grad, shard_sequence(x.grad, cp, rank, seq_dim=2), f"conv dx, cp {cp}")
        dist.all_reduce(w_local.grad)  # the weight is replicated: its gradient is the sum over ranks
        # A sum over every token, split across ranks: same scaled atol as above.
        atol = 1e-6 * max(1.0, weight.grad.abs().max().item())
        assert_close(w_local.grad, weight.grad, f"conv dweight, cp {cp}", atol=atol)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "cp,seqs",
    # 8 and 12 at cp 4: chunks of 1 and 2 tokens, shorter than the conv kernel;
    # 100 and 1000 need padding.
    [(2, (64, 100, 256, 1024)), (4, (8, 12, 64, 256, 1000))],
    ids=["cp2", "cp4"],
)
def test_cp_gated_delta_rule_and_conv_match_single_process(cp, seqs):
    run_world(_cp_ops_worker, cp, seqs)


def _comm_elements(fn) -> list[tuple[str, int]]:
    """(collective, elements sent) of every gloo collective `fn` runs, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    rows = []
    for event in prof.events():
        if event.name.startswith("gloo:"):
            numel = sum(int(torch.Size(shape).numel()) for shape in event.input_shapes if shape)
            rows.append((event.name, numel))
    return rows


def _comm_worker(rank: int, cp: int) -> None:
    from qwen35_accel.parallel.context_parallel.gated_delta_net import cp_gated_delta_rule

    measured = {}
    for seq in (256, 2048):
        local = [shard_sequence(t, cp, rank).requires_grad_() for t in _inputs(seq, seed=0)]
        out = {}
        forward = _comm_elements(lambda: out.update(y=cp_gated_delta_rule(*local, group=dist.group.WORLD)))
        backward = _comm_elements(lambda: out["y"].sum().backward())
        measured[seq] = (forward, backward)
    assert measured[256] == measured[2048], measured
    forward, backward = measured[256]
    # One all-gather of this rank's two (M, U) summaries: 2 x [B, V_HEADS, K_DIM, K_DIM + V_DIM].
    assert forward == [("gloo:all_gather", 2 * B * V_HEADS * K_DIM * (K_DIM + V_DIM))], forward
    assert [name for name, _ in backward] == ["gloo:all_reduce"], backward


@pytest.mark.multiprocess
def test_gated_delta_net_cp_communication_does_not_grow_with_sequence():
    run_world(_comm_worker, 2)
