"""The states entering a rank's two chunks, from every chunk's affine summary.

A chunk c of the GatedDeltaNet recurrence maps its incoming state as S_{c+1} = M_c S_c + U_c
(`ops.gated_delta.chunk_summary`); the whole sequence starts from S_0 = 0. Rank r holds
chunks a = r and b = 2·cp−1−r (`chunks`) and needs S_a and S_b. Two exchanges compute them:

- `"allgather"`: one all-gather of every rank's two summaries [M | U], then each rank folds
  the chunks before b in sequence order. Lowest latency (one collective); each rank
  receives 2·(cp−1) summaries and keeps the M_c and S_c of up to 2·cp−1 chunks for
  backward (copies: the gathered stack itself is freed after forward).
- `"scan"`: an exclusive Hillis–Steele scan over the 2·cp chunk positions in sequence
  order (chunk p held by `chunk_owner(p)`, so the zigzag's second half runs through the
  ranks in reverse), point to point: 1 + ⌈log2(2·cp−1)⌉ rounds, each rank sends and
  receives at most two summaries per round and keeps O(log cp) of them for backward. A
  span that already starts at chunk 0 travels as its state U alone (M is not needed:
  S_0 = 0).

Affine maps compose associatively, (M2, U2) ∘ (M1, U1) = (M2 M1, M2 U1 + U2); the two
exchanges differ only in the order of the products (fp32 rounding, ~1e-7 relative).
`"auto"` takes the all-gather below `scan_from_cp(backend)` ranks and the scan from there on.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist

from ..collectives import all_gather_with_grad
from ..options import CP_STATE_EXCHANGE_CHOICES as EXCHANGES  # declared with its knob
from .chunks import chunk_owner, rank_chunks

Exchange = Literal["auto", "allgather", "scan"]
# From which cp size on "auto" scans, per backend. gloo: measured, the scan's forward +
# backward takes 0.6-0.7x the all-gather's time at cp 2, 0.4x at cp 4, 0.1-0.2x at cp 8
# (benchmarks/results/cp_comm.md; gloo's all-gather and all-to-all are slower than its
# point-to-point on one machine). Elsewhere (NCCL: not measured yet) by bytes: the scan
# sends at most 2·(1 + ⌈log2(2cp−1)⌉) summaries per rank, the all-gather 2·(cp − 1), fewer
# from cp 8 on (10 vs 14), and below that one collective has the lowest latency.
SCAN_FROM_CP: dict[str, int] = {"gloo": 2}
SCAN_FROM_CP_DEFAULT = 8


def scan_from_cp(backend: str) -> int:
    """The smallest cp at which "auto" takes the scan on `backend` ("gloo", "nccl", …)."""
    return SCAN_FROM_CP.get(backend, SCAN_FROM_CP_DEFAULT)


def resolve_exchange(exchange: str, cp: int, backend: str = "nccl") -> str:
    """`"allgather"` or `"scan"` for a cp group of size `cp` on `backend` (`"auto"`: by `scan_from_cp`)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"state exchange {exchange!r} is not one of {EXCHANGES}")
    if exchange == "auto":
        return "scan" if cp >= scan_from_cp(backend) else "allgather"
    return exchange


def incoming_states(
    local: torch.Tensor, group: dist.ProcessGroup, k_dim: int, *, exchange: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering this rank's two chunks (slot 0: chunk r, slot 1: chunk 2·cp−1−r).

    `local` [2, batch, v_heads, k_dim, k_dim + v_dim] fp32: the two chunk summaries
    `[M | U]` in slot order. Returns two [batch, v_heads, k_dim, v_dim] fp32 states,
    differentiable with respect to `local` (gradients cross the same ranks in reverse).
    Every rank of `group` must call it with the same shapes and `exchange`.
    """
    cp = dist.get_world_size(group)
    if resolve_exchange(exchange, cp, dist.get_backend(group)) == "scan":
        states = _ScanStates.apply(local, group, k_dim)
        return states[0], states[1]
    return _allgather_states(local, group, k_dim)


def _allgather_states(local: torch.Tensor, group: dist.ProcessGroup, k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    gathered = all_gather_with_grad(local, group)  # [cp, 2, …]
    first, last = rank_chunks(rank, cp)
    state = torch.zeros_like(local[0, ..., k_dim:])
    states = {0: state}
    for chunk in range(last):
        M, U = gathered[chunk_owner(chunk, cp)].split([k_dim, local.shape[-1] - k_dim], dim=-1)
        # Copies, not views: what the product keeps for backward (M, the state) must not
        # keep the whole gathered [cp, 2, …] stack alive until backward.
        state = U.clone() if chunk == 0 else M.clone() @ state + U
        states[chunk + 1] = state
    return states[first], states[last]


def scan_rounds(cp: int) -> list[list[tuple[int, int, bool]]]:
    """The scan's messages: per round, (source chunk, destination chunk, U only?).

    Round 0 moves each chunk's summary to the next chunk (exclusive scan); round k ≥ 1
    moves the composition X_q (chunks max(0, q − 2^(k−1)) … q − 1) to chunk q + 2^(k−1),
    which composes it before its own. A span starting at chunk 0 is a state: U only.
    """
    n = 2 * cp
    rounds = [[(q, q + 1, q == 0) for q in range(n - 1)]]
    for k in range(1, math.ceil(math.log2(n - 1)) + 1):  # after round k, spans of 2^k chunks
        d = 2 ** (k - 1)
        rounds.append([(q, q + d, q <= d) for q in range(1, n - d)])
    return rounds


def exchange_bytes(exchange: str, cp: int, heads: int, k_dim: int, v_dim: int) -> dict[str, int]:
    """Bytes one rank sends (forward, backward) and keeps for backward, max over the cp
    ranks, in one GatedDeltaNet layer's state exchange; summaries are fp32.

    `exchange` "allgather" or "scan" (resolve "auto" first: `resolve_exchange`); `heads` =
    batch × the rank's value heads. Convention (`benchmarks/cp_comm.py`, checked there
    against the profiler): a ring all-gather sends (cp − 1) × its input, its backward (an
    all-to-all of the cp × gathered gradient) as much; the scan sends the messages of
    `scan_rounds` that cross ranks (a span from chunk 0 as U alone), backward each one's
    gradient back. Kept: the all-gather's fold keeps M_c and S_c of the chunks 1 … b − 1
    before a rank's last chunk b (rank 0: 2cp − 2 of each); the scan keeps M and the
    received message of every composition (rounds ≥ 1).
    """
    f = 4
    if exchange == "allgather":
        sent = (cp - 1) * f * 2 * heads * k_dim * (k_dim + v_dim)
        kept = f * (2 * cp - 2) * heads * (k_dim * k_dim + k_dim * v_dim)
        return {"forward": sent, "backward": sent, "kept": kept}
    if exchange != "scan":
        raise ValueError(f"exchange {exchange!r}: pass 'allgather' or 'scan' (resolve 'auto' with resolve_exchange)")
    fwd, bwd, kept = [0] * cp, [0] * cp, [0] * cp
    for round_index, messages in enumerate(scan_rounds(cp)):
        for src, dst, u_only in messages:
            size = f * heads * k_dim * (v_dim if u_only else k_dim + v_dim)
            src_rank, dst_rank = chunk_owner(src, cp)[0], chunk_owner(dst, cp)[0]
            if src_rank != dst_rank:
                fwd[src_rank] += size
                bwd[dst_rank] += size
            if round_index:
                kept[dst_rank] += f * heads * k_dim * k_dim + size
    return {"forward": max(fwd), "backward": max(bwd), "kept": max(kept)}


def _p2p(
    sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], group: dist.ProcessGroup, tag: int
) -> None:
    """Post every send and receive of one round (group ranks as peers), then wait for all."""
    ops = [dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=peer) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, tag=tag, group_peer=peer) for peer, t in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _ScanStates(torch.autograd.Function):
    """One autograd node for the whole scan: its backward runs the rounds in reverse as one
    step, so the p2p messages of a layer never interleave with other collectives
    differently on different ranks."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, k_dim: int) -> torch.Tensor:  # type: ignore[override]
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        mine = rank_chunks(rank, cp)
        v_dim = local.shape[-1] - k_dim
        element = {p: local[slot].clone() for slot, p in enumerate(mine)}  # not views of `local`
        X: dict[int, torch.Tensor | None] = {p: None for p in mine}  # the exclusive prefix of chunk p
        kept: list[torch.Tensor] = []  # per round and receiving chunk (in message order): M, R
        rounds = scan_rounds(cp)
        for k, messages in enumerate(rounds):
            payload = {}
            for src, dst, u_only in messages:
                if src in mine:
                    value = element[src] if k == 0 else X[src]
                    payload[src] = value[..., k_dim:] if u_only and k == 0 else value
            received = _exchange_round(messages, mine, payload, cp, group, tag=k, k_dim=k_dim, v_dim=v_dim, like=local)
            for dst, R in received.items():
                if k == 0:
                    X[dst] = R
                    continue
                old = X[dst]
                assert old is not None and old.shape[-1] == k_dim + v_dim
                M = old[..., :k_dim].clone()  # kept for backward without the old U
                new = M @ R
                new[..., -v_dim:] += old[..., k_dim:]
                kept += [M, R]
                X[dst] = new
        # Through save_for_backward, so activation checkpointing and saved-tensor hooks see them.
        ctx.save_for_backward(*kept)
        ctx.group, ctx.k_dim, ctx.v_dim = group, k_dim, v_dim
        zero = local.new_zeros(local.shape[1:-1] + (v_dim,))
        return torch.stack([zero if X[p] is None else X[p] for p in mine])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        group, k_dim, v_dim = ctx.group, ctx.k_dim, ctx.v_dim
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        mine = rank_chunks(rank, cp)
        rounds = scan_rounds(cp)
        dX = {p: grad[slot] for slot, p in enumerate(mine)}  # gradients of the final (complete) states
        d_local = grad.new_zeros(2, *grad.shape[1:-1], k_dim + v_dim)
        kept = list(ctx.saved_tensors)
        for k in reversed(range(len(rounds))):
            messages = rounds[k]
            # What this rank received in round k goes back as a gradient to its source.
            payload = {}
            for src, dst, u_only in reversed(messages):  # kept's order, from its end
                if dst not in mine:
                    continue
                if k == 0:
                    payload[dst] = dX.pop(dst)
                    continue
                R, M = kept.pop(), kept.pop()
                d_new = dX[dst]
                payload[dst] = M.transpose(-1, -2) @ d_new
                dX[dst] = torch.cat([d_new @ R.transpose(-1, -2), d_new[..., -v_dim:]], dim=-1)
            back = [(dst, src, u_only) for src, dst, u_only in messages]
            received = _exchange_round(back, mine, payload, cp, group, tag=k, k_dim=k_dim, v_dim=v_dim, like=grad)
            for src, d in received.items():
                if k == 0:
                    d_local[mine.index(src), ..., k_dim + v_dim - d.shape[-1] :] += d
                else:
                    dX[src] = dX[src] + d
        return d_local, None, None


def _exchange_round(
    messages: list[tuple[int, int, bool]],
    mine: tuple[int, int],
    payload: dict[int, torch.Tensor],
    cp: int,
    group: dist.ProcessGroup,
    *,
    tag: int,
    k_dim: int,
    v_dim: int,
    like: torch.Tensor,
) -> dict[int, torch.Tensor]:
    """One round: `payload[src]` goes from chunk src to chunk dst for each (src, dst, U only?)
    with src on this rank; returns {dst: tensor} for each dst on this rank (a message between
    two chunks of this rank is handed over without communication). Receive buffers take
    `like`'s dtype, device and [2, batch, v_heads, k_dim, …] shape."""
    sends, recvs, received = [], [], {}
    shape = like.shape[1:-1]
    for src, dst, u_only in messages:
        src_rank, dst_rank = chunk_owner(src, cp)[0], chunk_owner(dst, cp)[0]
        if src in mine and dst in mine:
            received[dst] = payload[src]
        elif src in mine:
            sends.append((dst_rank, payload[src].contiguous()))
        elif dst in mine:
            received[dst] = like.new_empty(*shape, v_dim if u_only else k_dim + v_dim)
            recvs.append((src_rank, received[dst]))
    _p2p(sends, recvs, group, tag)
    return received
