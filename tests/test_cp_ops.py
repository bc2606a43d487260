"""Context-parallel GatedDeltaNet ops equal the single-process chunked rule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_chunk_gated_delta_rule

from _dist import run_world
from _parity import assert_close
from qwen35_accel.ops.gated_delta import chunk_summary, fold_states, read_state
from qwen35_accel.parallel.context_parallel.chunks import (
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


def _check_cp_rule(rank: int, cp: int, seq: int, exchange: str) -> None:
    """cp_gated_delta_rule with `exchange` against the single-process rule: output and every input's gradient."""
    from qwen35_accel.parallel.context_parallel.gated_delta_net import cp_gated_delta_rule

    padded_seq = seq + (-seq) % (2 * cp)
    inputs = _inputs(seq, seed=seq, requires_grad=True)
    out_ref, _ = _reference(*inputs)
    weights = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7))
    (out_ref * weights).sum().backward()

    local = [shard_sequence(pad_for_context_parallel(t.detach(), cp), cp, rank).requires_grad_() for t in inputs]
    out = cp_gated_delta_rule(*local, group=dist.group.WORLD, exchange=exchange)
    positions = local_positions(padded_seq, cp, rank)
    real = positions < seq  # padded tokens (right padding) are dropped
    what = f"cp {cp}, seq {seq}, {exchange}"
    assert_close(out[:, real], out_ref.detach()[:, positions[real]], f"output, {what}")
    local_weights = shard_sequence(pad_for_context_parallel(weights, cp), cp, rank)
    (out[:, real] * local_weights[:, real]).sum().backward()
    for name, t, t_local in zip(("q", "k", "v", "g", "beta"), inputs, local):
        # Gradients of g and beta are sums over a 64-token kernel chunk (and the head
        # dims) of terms as large as the tensor's largest entries (~5 here); CP moves
        # the chunk boundaries, so their rounding differs by ~eps·sqrt(64)·max|grad|.
        # atol therefore scales with max|grad|: 1e-6 for gradients of magnitude ≤ 1.
        # (A wrong state across chunks shows at ~1e-4 with this weak decay.)
        atol = 1e-6 * max(1.0, t.grad.abs().max().item())
        assert_close(t_local.grad[:, real], t.grad[:, positions[real]], f"d{name}, {what}", atol=atol)


def _cp_ops_worker(rank: int, cp: int, seqs: tuple[int, ...], scan_seqs: tuple[int, ...]) -> None:
    from qwen35_accel.parallel.context_parallel.gated_delta_net import cp_causal_conv1d

    group = dist.group.WORLD
    for seq in scan_seqs:
        _check_cp_rule(rank, cp, seq, "scan")
    for seq in seqs:
        _check_cp_rule(rank, cp, seq, "allgather")
        padded_seq = seq + (-seq) % (2 * cp)

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
    "cp,seqs,scan_seqs",
    # 8 and 12 at cp 4: chunks of 1 and 2 tokens, shorter than the conv kernel;
    # 100 and 1000 need padding. The scan exchange on a few of them (cp 8: below).
    [(2, (64, 100, 256, 1024), (100, 256)), pytest.param(4, (8, 12, 64, 256, 1000), (12, 1000), marks=pytest.mark.slow)],
    ids=["cp2", "cp4"],
)
def test_cp_gated_delta_rule_and_conv_match_single_process(cp, seqs, scan_seqs):
    run_world(_cp_ops_worker, cp, seqs, scan_seqs)


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
        forward = _comm_elements(lambda: out.update(y=cp_gated_delta_rule(*local, group=dist.group.WORLD, exchange="allgather")))
        backward = _comm_elements(lambda: out["y"].sum().backward())
        measured[seq] = (forward, backward)
    assert measured[256] == measured[2048], measured
    forward, backward = measured[256]
    # One all-gather of this rank's two (M, U) summaries: 2 x [B, V_HEADS, K_DIM, K_DIM + V_DIM];
    # backward reduce-scatters its gradient: on gloo an all-to-all of the [cp, ...] stack
    # (each rank sends the others' slots: the all-gather's bytes), not an all-reduce.
    summaries = 2 * B * V_HEADS * K_DIM * (K_DIM + V_DIM)
    assert forward == [("gloo:all_gather", summaries)], forward
    assert backward == [("gloo:all_to_all", cp * summaries)], backward


@pytest.mark.multiprocess
@pytest.mark.slow  # traffic, not parity: the cp2 test above is the fast tier's
def test_gated_delta_net_cp_communication_does_not_grow_with_sequence():
    run_world(_comm_worker, 2)


def _exchanges_worker(rank: int, cp: int) -> None:
    from qwen35_accel.parallel.context_parallel.state_exchange import incoming_states, scan_rounds
    from qwen35_accel.testing.saved_tensors import saved_storage_bytes

    # The whole rule at cp 8 (chunks of 3 tokens), both exchanges against one process.
    for exchange in ("allgather", "scan"):
        _check_cp_rule(rank, cp, 48, exchange)

    # The exchange alone: same states and gradients (only the order of the products
    # differs: fp32 rounding), traffic and what each keeps for backward.
    # Real chunk summaries (M contracts, as a decaying recurrence's does) of 4-token chunks.
    halves = [shard_sequence(t, cp, rank).chunk(2, dim=1) for t in _inputs(8 * cp, seed=5)]
    local = torch.stack([torch.cat(chunk_summary(*(h[slot] for h in halves))[2:], dim=-1) for slot in (0, 1)])
    weights = torch.randn(2, B, V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(rank))
    results, saved, traffic = {}, {}, {}
    for exchange in ("allgather", "scan"):
        x = local.clone().requires_grad_()
        out = {}
        forward = _comm_elements(lambda: out.update(zip(("states", "saved"), saved_storage_bytes(
            lambda: torch.stack(incoming_states(x, dist.group.WORLD, K_DIM, exchange=exchange))))))
        backward = _comm_elements(lambda: (out["states"] * weights).sum().backward())
        results[exchange] = (out["states"].detach(), x.grad)
        saved[exchange], traffic[exchange] = out["saved"], (forward, backward)
    for what, a, b in zip(("states", "gradient"), results["allgather"], results["scan"]):
        assert_close(b, a, f"scan vs all-gather {what}, cp {cp}", rtol=1e-5, atol=1e-6)  # fp32: products in another order

    summary, state = B * V_HEADS * K_DIM * (K_DIM + V_DIM), B * V_HEADS * K_DIM * V_DIM
    # All-gather: copies of M_c and S_c for the chunks 1 … b−1 before this rank's last chunk
    # b = 2cp−1−rank, not the gathered [cp, 2, …] stack (4 bytes each, fp32).
    b = 2 * cp - 1 - rank
    assert saved["allgather"] == 4 * (b - 1) * (B * V_HEADS * K_DIM * K_DIM + state), (rank, saved)
    # Scan: 1 + ⌈log2(2cp − 1)⌉ rounds of point-to-point messages, at most two summaries
    # sent and received per rank and round, each way; per received message M and the
    # message kept.
    rounds = len(scan_rounds(cp))
    assert rounds == 5
    forward, backward = traffic["scan"]
    for direction in (forward, backward):
        assert {name for name, _ in direction} <= {"gloo:send", "gloo:recv"}, direction
        for name in ("gloo:send", "gloo:recv"):
            sizes = [n for event, n in direction if event == name]
            assert len(sizes) <= 2 * rounds and all(n in (summary, state) for n in sizes), (name, direction)
    assert saved["scan"] <= 4 * 2 * (rounds - 1) * (B * V_HEADS * K_DIM * K_DIM + summary), (rank, saved)
    assert traffic["allgather"][0] == [("gloo:all_gather", 2 * summary)], traffic


@pytest.mark.multiprocess
@pytest.mark.slow  # world 8
def test_scan_and_allgather_exchanges_at_cp8_match_single_process():
    """cp 8 on 2 cores: tiny shapes, one world."""
    run_world(_exchanges_worker, 8)
