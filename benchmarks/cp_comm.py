"""Context-parallel traffic of one GatedDeltaNet layer: ours vs all-gathering the hidden states,
and the two state exchanges (one all-gather, a log-depth scan) at cp 2, 4 and 8.

    python benchmarks/cp_comm.py [--measure-seqs 1024 2048 4096] [--cp 2] [--exchange-cp 2 4 8] [--batch 1] [--smoke]

Bytes each rank sends per GatedDeltaNet layer, forward and backward:
- ours (`ContextParallelGatedDeltaNet`, all-gather exchange): one all-gather of the conv
  halo (the last K-1 pre-conv inputs of each of the rank's two chunks) and one all-gather
  of the two chunk state summaries (M, U in fp32); backward reduce-scatters the gradients
  of both gathered stacks (on gloo an all-to-all: `collectives.reduce_scatter_stack`);
- all-gather (the simple approach): each GatedDeltaNet layer all-gathers the whole hidden
  sequence [B, S, hidden] (`all_gather_with_grad`), runs the unmodified Transformers layer
  on it, keeps its local tokens; backward reduce-scatters the gradient of the gathered sequence.
- the state exchange alone (`state_exchange.incoming_states`), "allgather" and "scan", at
  cp 2, 4, 8: bytes sent, what it keeps for backward (saved-tensor storages), latency.

Convention: bytes a rank sends, from each gloo collective's input as the profiler records
it (`gloo:*` events: input shapes and dtypes): all_gather (ring) (cp−1) × input; all_to_all
(cp−1)/cp × input (its own slot stays); all_reduce (ring) 2(cp−1)/cp × input; send × 1.
Assumed dtypes: bf16 compute (hidden states, halo), fp32 state summaries.

The formulas are checked against the profiler on local gloo worlds (the layer at a few
sequences that fit on CPU, 4B-like shape; the exchanges at the 4B-like and 27B-like
summary shapes); any mismatch exits non-zero. Then the formulas give sequences 1k…128k
and cp up to 32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

import _report

# Our assumed shapes ("-like": not read from any checkpoint).
SHAPES: dict[str, dict[str, int]] = {
    "4B-like": dict(hidden=2560, k_heads=16, v_heads=32, k_dim=128, v_dim=128, conv_kernel=4),
    "27B-like": dict(hidden=5120, k_heads=16, v_heads=48, k_dim=128, v_dim=128, conv_kernel=4),
}
# --smoke measures (and checks the formulas on) a small layer instead of the 4B-like one.
SMOKE_SHAPE = dict(hidden=64, k_heads=2, v_heads=4, k_dim=16, v_dim=16, conv_kernel=4)
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
COMPUTE = "bf16"  # hidden states and halo travel in the compute dtype
SUMMARY = "fp32"  # state summaries are always fp32 (chunk_summary computes in fp32)


def conv_dim(shape: dict[str, int]) -> int:
    return 2 * shape["k_heads"] * shape["k_dim"] + shape["v_heads"] * shape["v_dim"]


def sent_fraction(collective: str, cp: int) -> float:
    """Bytes a rank sends per byte of the collective's input (see the module's convention)."""
    kind = collective.removeprefix("gloo:")
    return {"all_gather": cp - 1, "all_to_all": (cp - 1) / cp, "all_reduce": 2 * (cp - 1) / cp, "send": 1.0,
            "recv": 0.0}[kind]


def ours_collectives(seq: int, cp: int, batch: int, shape: dict[str, int]) -> dict[str, list[tuple[str, int, str, str]]]:
    """Per direction: (what, input elements of one rank, dtype, collective) of each collective.

    forward:  halo      2·B·conv_dim·min(S/(2cp), K−1)         [compute dtype]  all_gather
              summaries 2·B·Hv·Dk·(Dk+Dv)                       [fp32]           all_gather
    backward: the gradient of each gathered [cp, …] stack (cp × the elements), all_to_all.
    conv_dim = 2·Hk·Dk + Hv·Dv. Independent of S once S/(2cp) ≥ K−1.
    """
    tail = min(seq // (2 * cp), shape["conv_kernel"] - 1)
    halo = 2 * batch * conv_dim(shape) * tail
    forward = [("halo", halo, COMPUTE, "all_gather"), ("state summaries", summary_elements(batch, shape), SUMMARY, "all_gather")]
    return {"forward": forward, "backward": [(what, cp * n, dtype, "all_to_all") for what, n, dtype, _ in forward]}


def summary_elements(batch: int, shape: dict[str, int]) -> int:
    """A rank's two chunk summaries [M | U]: 2·B·Hv·Dk·(Dk+Dv)."""
    return 2 * batch * shape["v_heads"] * shape["k_dim"] * (shape["k_dim"] + shape["v_dim"])


def allgather_collectives(seq: int, cp: int, batch: int, shape: dict[str, int]) -> dict[str, list[tuple[str, int, str, str]]]:
    """forward: all_gather of B·(S/cp)·hidden [compute dtype]; backward: all_to_all of cp × that = B·S·hidden."""
    local = batch * (seq // cp) * shape["hidden"]
    return {"forward": [("hidden states", local, COMPUTE, "all_gather")],
            "backward": [("hidden states", cp * local, COMPUTE, "all_to_all")]}


def total_bytes(collectives: list[tuple[str, int, str, str]], cp: int) -> int:
    """Bytes one rank sends for these collectives."""
    return round(sum(n * DTYPE_BYTES[dtype] * sent_fraction(kind, cp) for _, n, dtype, kind in collectives))


def exchange_formulas(exchange: str, cp: int, batch: int, shape: dict[str, int]) -> dict[str, int]:
    """Max over ranks of the state exchange's bytes sent (fwd, bwd) and bytes kept for backward:
    `state_exchange.exchange_bytes` (what `qwen35-accel plan` reports), checked here against
    the profiler and the saved-tensor storages."""
    from qwen35_accel.parallel.context_parallel.state_exchange import exchange_bytes

    return exchange_bytes(exchange, cp, batch * shape["v_heads"], shape["k_dim"], shape["v_dim"])


# ---------------------------------------------------------------- measurement (workers)

_TORCH_DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64"}


def _profile_collectives(fn) -> list[tuple[str, int, str | None]]:
    """(event name, elements, dtype or None where the profiler records none) of every gloo
    collective `fn` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    rows = []
    for event in prof.events():
        if event.name.startswith("gloo:"):
            shapes = [s for s in event.input_shapes if s]
            numel = sum(int(torch.Size(s).numel()) for s in shapes)
            recorded = getattr(event, "input_dtypes", None)  # not recorded by torch's profiler before 2.13
            if recorded is None:
                rows.append((event.name, numel, None))
                continue
            kinds = {_TORCH_DTYPES.get(d, d) for s, d in zip(event.input_shapes, recorded) if s}
            rows.append((event.name, numel, kinds.pop() if len(kinds) == 1 else "/".join(sorted(kinds))))
    return rows


class AllGatherHiddenGatedDeltaNet(torch.nn.Module):
    """The all-gather approach: gather [B, S, hidden], run the unmodified layer, keep local tokens."""

    def __init__(self, layer: torch.nn.Module, group) -> None:
        super().__init__()
        self.layer = layer
        self.group = group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        from qwen35_accel.parallel.collectives import (
            all_gather_with_grad,
        )
        from qwen35_accel.parallel.context_parallel.chunks import (
            shard_sequence,
            unshard_sequence,
        )

        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        gathered = all_gather_with_grad(hidden_states, self.group)
        whole = unshard_sequence(list(gathered.unbind(0)), cp, 1)
        return shard_sequence(self.layer(whole), cp, rank, 1)


def _measure_worker(rank: int, world: int, seqs: list[int], batch: int, dtype_name: str, s: dict[str, int], out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.parallel.context_parallel.chunks import shard_sequence
    from qwen35_accel.parallel.context_parallel.model import install_context_parallel
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    config = dict(
        hidden_size=s["hidden"], intermediate_size=64, num_hidden_layers=1, layer_types=["linear_attention"],
        linear_num_key_heads=s["k_heads"], linear_num_value_heads=s["v_heads"], linear_key_head_dim=s["k_dim"],
        linear_value_head_dim=s["v_dim"], linear_conv_kernel_dim=s["conv_kernel"], max_position_embeddings=max(seqs),
    )
    cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ours_model = build_tiny_causal_lm(seed=0, dtype=dtype, **config)
    install_fp32_gate(ours_model)
    install_context_parallel(ours_model, cp_mesh)  # no FSDP: only CP traffic is on the wire
    ours = ours_model.model.layers[0].linear_attn
    ours.state_exchange = "allgather"  # the exchanges are compared on their own below
    # Same weights, the unmodified Transformers layer.
    baseline = AllGatherHiddenGatedDeltaNet(build_tiny_causal_lm(seed=0, dtype=dtype, **config).model.layers[0].linear_attn, cp_mesh.get_group())

    results = {}
    for seq in seqs:
        gen = torch.Generator().manual_seed(seq)
        hidden = torch.randn(batch, seq, s["hidden"], generator=gen).to(dtype)
        grad_out = torch.randn(batch, seq, s["hidden"], generator=gen).to(dtype)
        local_hidden, local_grad = shard_sequence(hidden, world, rank), shard_sequence(grad_out, world, rank)
        entry = {}
        outputs = {}
        for name, layer in (("ours", ours), ("allgather", baseline)):
            x = local_hidden.clone().requires_grad_()
            out = {}
            forward = _profile_collectives(lambda layer=layer, x=x, out=out: out.update(y=layer(x)))
            backward = _profile_collectives(lambda out=out, grad=local_grad: out["y"].backward(grad))
            entry[name] = {"forward": forward, "backward": backward}
            outputs[name] = out["y"].detach().float()
        # Sanity: both approaches compute the same layer output at this rank's tokens.
        ref = outputs["allgather"]
        entry["output_rel_err"] = float((outputs["ours"] - ref).abs().max() / ref.abs().max())
        results[seq] = entry
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))


def _exchange_worker(rank: int, world: int, shapes: dict[str, dict[str, int]], batch: int, reps: int, out_path: str) -> None:
    """The state exchange alone, per exchange and summary shape: collectives (profiler), bytes
    kept for backward (saved-tensor storages), and the median time of forward + backward."""
    import time

    import torch.distributed as dist

    from qwen35_accel.parallel.context_parallel.state_exchange import incoming_states
    from qwen35_accel.testing.saved_tensors import saved_storage_bytes

    group = dist.group.WORLD
    results = {}
    for name, s in shapes.items():
        k, v = s["k_dim"], s["v_dim"]
        gen = torch.Generator().manual_seed(rank)
        # Contracting transitions, as a decaying recurrence's are (values do not matter here).
        local = torch.cat([0.1 * torch.randn(2, batch, s["v_heads"], k, k, generator=gen) / k**0.5,
                           torch.randn(2, batch, s["v_heads"], k, v, generator=gen)], dim=-1)
        weights = torch.randn(2, batch, s["v_heads"], k, v, generator=gen)
        entry = {}
        for exchange in ("allgather", "scan"):
            x = local.clone().requires_grad_()
            out = {}
            forward = _profile_collectives(lambda: out.update(zip(("y", "kept"), saved_storage_bytes(
                lambda: torch.stack(incoming_states(x, group, k, exchange=exchange))))))
            backward = _profile_collectives(lambda: (out["y"] * weights).sum().backward())
            entry[exchange] = {"forward": forward, "backward": backward, "kept": out["kept"], "states": out["y"].detach()}
        rel = (entry["scan"]["states"] - entry["allgather"]["states"]).abs().max() / entry["allgather"]["states"].abs().max()
        times = {"allgather": [], "scan": []}
        for _ in range(reps):  # alternating, side by side
            for exchange in times:
                x = local.clone().requires_grad_()
                dist.barrier(group)
                start = time.perf_counter()
                (torch.stack(incoming_states(x, group, k, exchange=exchange)) * weights).sum().backward()
                times[exchange].append(time.perf_counter() - start)
        for exchange in times:
            entry[exchange].pop("states")
            entry[exchange]["seconds"] = sorted(times[exchange])[len(times[exchange]) // 2]
        entry["rel_diff"] = float(rel)
        results[name] = entry
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))


def _exchange_section(cps: list[int], shapes: dict[str, dict[str, int]], batch: int, reps: int,
                      failures: list[str]) -> list[str]:
    from qwen35_accel.testing.local_world import run_local_world

    lines = [f"## The state exchange alone: measured (profiler, gloo, batch {batch}, fp32 summaries)\n",
             "Per rank per GatedDeltaNet layer, max over ranks: bytes sent (module convention), bytes of the "
             "storages its saved tensors keep until backward, median wall time of forward + backward of the "
             f"exchange alone ({reps} alternating repetitions, every rank waiting at a barrier before each; 1 thread "
             "per rank, cp processes sharing the machine's cores). `formula` checks bytes sent (and kept) "
             "against `exchange_formulas`.\n",
             "| shape | cp | exchange | fwd sent | bwd sent | kept for backward | median fwd + bwd (ms) | scan / all-gather time | formula match | max rel diff scan vs all-gather |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cp in cps:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "exchange.json")
            run_local_world(_exchange_worker, cp, shapes, batch, reps, path, threads_per_rank=1)
            per_rank = json.loads(Path(path).read_text())
        for name, shape in shapes.items():
            for exchange in ("allgather", "scan"):
                formula = exchange_formulas(exchange, cp, batch, shape)
                cells, ok = {}, True
                for direction in ("forward", "backward"):
                    sent = [round(sum(n * DTYPE_BYTES[d or SUMMARY] * sent_fraction(c, cp) for c, n, d in r[name][exchange][direction]))
                            for r in per_rank]
                    cells[direction] = max(sent)
                    ok &= cells[direction] == formula[direction]
                kept = max(r[name][exchange]["kept"] for r in per_rank)
                ok &= kept == formula["kept"] if exchange == "allgather" else kept <= formula["kept"]
                if not ok:
                    failures.append(f"exchange {exchange} cp {cp} {name}: measured {cells}, kept {kept}, formula {formula}")
                seconds = max(r[name][exchange]["seconds"] for r in per_rank)
                ratio = seconds / max(r[name]["allgather"]["seconds"] for r in per_rank)
                rel = max(r[name]["rel_diff"] for r in per_rank)
                lines.append(
                    f"| {name} | {cp} | {exchange} | {_fmt_bytes(cells['forward'])} | {_fmt_bytes(cells['backward'])} | "
                    f"{_fmt_bytes(kept)} | {seconds * 1e3:.1f} | {ratio:.2f} | {'yes' if ok else 'NO'} | {rel:.1e} |"
                )
    return lines


def _exchange_computed(shape_name: str, shape: dict[str, int], batch: int) -> list[str]:
    lines = [f"\n## The state exchange, computed from the formulas: {shape_name}, batch {batch}\n",
             "Per rank per GatedDeltaNet layer (max over ranks). `auto` (`state_exchange.scan_from_cp`): on gloo "
             "the scan from cp 2 (measured above: faster at every cp measured); on NCCL the all-gather below cp 8 "
             "(one collective; not measured here) and the scan from cp 8 (fewer bytes).\n",
             "| cp | all-gather fwd = bwd sent | all-gather kept | scan fwd sent | scan bwd sent | scan kept | auto, gloo | auto, NCCL |",
             "|---|---|---|---|---|---|---|---|"]
    from qwen35_accel.parallel.context_parallel.state_exchange import resolve_exchange

    for cp in (2, 4, 8, 16, 32):
        a, s = exchange_formulas("allgather", cp, batch, shape), exchange_formulas("scan", cp, batch, shape)
        lines.append(f"| {cp} | {_fmt_bytes(a['forward'])} | {_fmt_bytes(a['kept'])} | {_fmt_bytes(s['forward'])} | "
                     f"{_fmt_bytes(s['backward'])} | {_fmt_bytes(s['kept'])} | {resolve_exchange('auto', cp, 'gloo')} | "
                     f"{resolve_exchange('auto', cp, 'nccl')} |")
    return lines


# ---------------------------------------------------------------- report (parent)


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _check(measured: list[list], formula: list[tuple[str, int, str, str]], measure_dtype: str, cp: int) -> tuple[bool, int]:
    """Collectives and elements must match (as a multiset); returns (ok, bytes sent at the assumed dtypes).

    Measured in the compute dtype (bf16), each collective's measured dtype must also be
    the formula's, so measured bytes are exactly the formula's bytes.
    """
    ok = sorted((c, n) for c, n, _ in measured) == sorted((f"gloo:{c}", n) for _, n, _, c in formula)
    if ok and measure_dtype == COMPUTE and all(d is not None for _, _, d in measured):  # elements only without dtypes
        ok = sorted((n, d) for _, n, d in measured) == sorted((n, d) for _, n, d, _ in formula)
    # Bytes: measured elements priced at the dtype of the formula's collective of that size.
    price = {n: DTYPE_BYTES[d] for _, n, d, _ in formula}
    return ok, round(sum(n * price.get(n, 0) * sent_fraction(c, cp) for c, n, _ in measured))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure-seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--cp", type=int, default=2, help="cp size of the measured world and of the computed tables")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--measure-dtype", choices=["bf16", "fp32"], default="bf16",
                        help="dtype of the measured layer (fp32: elements checked, bytes priced at the assumed dtypes)")
    parser.add_argument("--max-seq", type=int, default=128 * 1024)
    parser.add_argument("--exchange-cp", type=int, nargs="+", default=[2, 4, 8], help="cp sizes of the state exchange worlds")
    parser.add_argument("--exchange-reps", type=int, default=15, help="timed repetitions of each exchange")
    _report.add_arguments(parser)
    args = parser.parse_args()
    exchange_shapes = {name: SHAPES[name] for name in ("4B-like", "27B-like")}
    if args.smoke:
        args.measure_seqs = [32, 64]
        args.exchange_cp, args.exchange_reps = [2, 4], 2
        exchange_shapes = {"small (smoke)": SMOKE_SHAPE}
    measured_name, shape = ("small (smoke)", SMOKE_SHAPE) if args.smoke else ("4B-like", SHAPES["4B-like"])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from qwen35_accel.testing.local_world import run_local_world

    run = _report.Run()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "measured.json")
        run_local_world(_measure_worker, args.cp, args.measure_seqs, args.batch, args.measure_dtype, shape, path, threads_per_rank=1)
        per_rank = json.loads(Path(path).read_text())

    lines: list[str] = []
    failures: list[str] = []
    lines.append(f"## Measured (profiler, gloo, cp={args.cp}, batch {args.batch}, {measured_name} layer computed in {args.measure_dtype})\n")
    priced = "" if args.measure_dtype == COMPUTE else f" Elements measured in {args.measure_dtype}, priced at the assumed dtypes ({COMPUTE} compute, {SUMMARY} summaries)."
    lines.append(f"Bytes per rank per GatedDeltaNet layer (max over ranks; every rank measured and checked).{priced}\n")
    lines.append("| seq | ours fwd | ours bwd | all-gather fwd | all-gather bwd | formula match | ours vs all-gather output (max rel err) |")
    lines.append("|---|---|---|---|---|---|---|")
    measured_points: dict[str, dict[int, int]] = {"ours": {}, "allgather": {}}
    for seq in args.measure_seqs:
        formulas = {"ours": ours_collectives(seq, args.cp, args.batch, shape), "allgather": allgather_collectives(seq, args.cp, args.batch, shape)}
        cells = {}
        all_ok = True
        for approach in ("ours", "allgather"):
            totals = []
            for direction in ("forward", "backward"):
                worst = 0
                for rank, results in enumerate(per_rank):
                    measured = results[str(seq)][approach][direction]
                    ok, nbytes = _check(measured, formulas[approach][direction], args.measure_dtype, args.cp)
                    if not ok:
                        all_ok = False
                        failures.append(f"seq {seq} rank {rank} {approach} {direction}: measured {measured}, formula {formulas[approach][direction]}")
                    worst = max(worst, nbytes)
                cells[(approach, direction)] = worst
                totals.append(worst)
            measured_points[approach][seq] = sum(totals)
        err = max(r[str(seq)]["output_rel_err"] for r in per_rank)
        lines.append(
            f"| {seq} | {_fmt_bytes(cells[('ours', 'forward')])} | {_fmt_bytes(cells[('ours', 'backward')])} | "
            f"{_fmt_bytes(cells[('allgather', 'forward')])} | {_fmt_bytes(cells[('allgather', 'backward')])} | "
            f"{'yes' if all_ok else 'NO'} | {err:.1e} |"
        )
    example = per_rank[0][str(args.measure_seqs[0])]
    lines.append(f"\nCollectives seen at seq {args.measure_seqs[0]}, rank 0 (name, elements, dtype):")
    for approach in ("ours", "allgather"):
        for direction in ("forward", "backward"):
            lines.append(f"- {approach} {direction}: {[tuple(c) for c in example[approach][direction]]}")

    lines.append("\n## Formulas (bytes one rank sends per GatedDeltaNet layer)\n")
    lines.append(
        "S sequence, cp context-parallel size, B batch, Hk/Hv linear key/value heads, Dk/Dv key/value head dims, "
        "K conv kernel, conv_dim = 2·Hk·Dk + Hv·Dv; c = compute dtype bytes (bf16: 2); f = 4 (fp32 summaries).\n"
    )
    lines.append("- ours fwd = (cp−1)·[c·2·B·conv_dim·min(S/(2cp), K−1) + f·2·B·Hv·Dk·(Dk+Dv)]  (constant in S; all-gather exchange)")
    lines.append("- ours bwd = ours fwd (reduce-scatter: an all-to-all on gloo)")
    lines.append("- all-gather fwd = (cp−1)·c·B·(S/cp)·hidden")
    lines.append("- all-gather bwd = all-gather fwd")
    lines.append("- ratio = (all-gather fwd + bwd) / (ours fwd + bwd)")

    seqs = []
    n = 1024
    while n <= args.max_seq:
        seqs.append(n)
        n *= 2
    computed: dict[str, dict[str, list[int]]] = {}
    for name, shape in SHAPES.items():
        dims = ", ".join(f"{k} {v}" for k, v in shape.items())
        lines.append(f"\n## Computed from the formulas: {name} ({dims}), cp={args.cp}, batch {args.batch}, bf16 compute, fp32 summaries\n")
        lines.append("| seq | ours fwd | ours bwd | ours fwd + bwd | all-gather fwd | all-gather bwd | all-gather fwd + bwd | ratio all-gather/ours |")
        lines.append("|---|---|---|---|---|---|---|---|")
        computed[name] = {"ours": [], "allgather": []}
        for seq in seqs:
            o = ours_collectives(seq, args.cp, args.batch, shape)
            a = allgather_collectives(seq, args.cp, args.batch, shape)
            of, ob = total_bytes(o["forward"], args.cp), total_bytes(o["backward"], args.cp)
            af, ab = total_bytes(a["forward"], args.cp), total_bytes(a["backward"], args.cp)
            computed[name]["ours"].append(of + ob)
            computed[name]["allgather"].append(af + ab)
            lines.append(
                f"| {seq} | {_fmt_bytes(of)} | {_fmt_bytes(ob)} | {_fmt_bytes(of + ob)} | {_fmt_bytes(af)} | {_fmt_bytes(ab)} | "
                f"{_fmt_bytes(af + ab)} | {(af + ab) / (of + ob):.2f} |"
            )
        # Break-even: all-gather total = ours total.
        ours_total = computed[name]["ours"][-1]
        per_token = 2 * (args.cp - 1) * DTYPE_BYTES[COMPUTE] * args.batch * shape["hidden"] / args.cp
        lines.append(f"\nBreak-even at S ≈ {ours_total / per_token:.0f} tokens: below it the all-gather approach moves fewer bytes.")

    lines.append("")
    lines += _exchange_section(args.exchange_cp, exchange_shapes, args.batch, args.exchange_reps, failures)
    lines += _exchange_computed("27B-like", SHAPES["27B-like"], args.batch)

    table = "\n".join(lines)
    print(table)
    if failures:
        print("\nFORMULA MISMATCH:\n" + "\n".join(failures), file=sys.stderr)

    folder = _report.results_dir(args)
    if folder is not None:
        plt = _report.pyplot()
        run.write(folder, "cp_comm.md", "GatedDeltaNet context-parallel traffic per rank per layer",
                  f"Collectives: gloo, 1 thread per rank.\n\n{table}\n"
                  + ("\n![bytes vs sequence](cp_comm.png)\n" if plt else "")
                  + ("\n**FORMULA MISMATCH** (see stderr of the run)\n" if failures else ""))
        if plt:
            _plot(plt, seqs, computed, measured_points, args, folder)
    if failures:
        sys.exit(1)


def _plot(plt, seqs, computed, measured_points, args, folder: Path) -> None:
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = {"ours": "tab:blue", "allgather": "tab:red"}
    labels = {"ours": "ours (halo + state summaries)", "allgather": "all-gather hidden states"}
    styles = {"4B-like": "-", "27B-like": "--"}
    for name, series in computed.items():
        for approach, values in series.items():
            ax.plot(seqs, [v / 2**20 for v in values], styles[name], color=colors[approach], label=f"{labels[approach]}, {name}")
    for approach, points in measured_points.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] / 2**20 for x in xs], "o", color=colors[approach], markerfacecolor="none", markersize=9,
                label=f"measured (profiler), {labels[approach]}, 4B-like")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs, [f"{s // 1024}k" for s in seqs])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("MiB per rank per GatedDeltaNet layer (fwd + bwd)")
    ax.set_title(f"CP traffic per GatedDeltaNet layer, cp={args.cp}, batch {args.batch}, bf16 compute / fp32 summaries", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "cp_comm.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
