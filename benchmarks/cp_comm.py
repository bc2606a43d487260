"""Context-parallel traffic of one GatedDeltaNet layer: ours vs all-gathering the hidden states.

    python benchmarks/cp_comm.py [--measure-seqs 1024 2048 4096] [--cp 2] [--batch 1] [--smoke]

Bytes each rank contributes per GatedDeltaNet layer, forward and backward:
- ours (`ContextParallelGatedDeltaNet`): one all-gather of the conv halo (the last K-1
  pre-conv inputs of each of the rank's two chunks) and one all-gather of the two chunk
  state summaries (M, U in fp32); backward reduces the gradients of both gathered stacks;
- all-gather (the simple approach): each GatedDeltaNet layer all-gathers the whole hidden
  sequence [B, S, hidden] (`all_gather_with_grad`), runs the unmodified Transformers layer
  on it, keeps its local tokens; backward reduces the gradient of the gathered sequence.

Convention: the payload a rank contributes to each collective: the all-gather input in
forward; in backward the gradient tensor that is reduced (the whole gathered stack, cp x
the forward payload: gloo all-reduces it, NCCL reduce-scatters it), in bytes of the tensor
dtype. Assumed dtypes: bf16 compute (hidden states, halo), fp32 state summaries.

The formulas are checked against the torch profiler (`gloo:*` events, input shapes and
dtypes) on a local gloo world at a few sequences that fit on CPU, for the 4B-like shape;
any mismatch exits non-zero. Then the formulas give sequences 1k…128k at two shapes.
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


def ours_collectives(seq: int, cp: int, batch: int, shape: dict[str, int]) -> dict[str, list[tuple[str, int, str]]]:
    """Per direction: (what, elements contributed by one rank, dtype) of each collective.

    forward:  halo      2·B·conv_dim·min(S/(2cp), K−1)         [compute dtype]
              summaries 2·B·Hv·Dk·(Dk+Dv)                       [fp32]
    backward: the same, × cp (gradient of the gathered [cp, …] stack).
    conv_dim = 2·Hk·Dk + Hv·Dv. Independent of S once S/(2cp) ≥ K−1.
    """
    tail = min(seq // (2 * cp), shape["conv_kernel"] - 1)
    halo = 2 * batch * conv_dim(shape) * tail
    summaries = 2 * batch * shape["v_heads"] * shape["k_dim"] * (shape["k_dim"] + shape["v_dim"])
    forward = [("halo", halo, COMPUTE), ("state summaries", summaries, SUMMARY)]
    return {"forward": forward, "backward": [(what, cp * n, dtype) for what, n, dtype in forward]}


def allgather_collectives(seq: int, cp: int, batch: int, shape: dict[str, int]) -> dict[str, list[tuple[str, int, str]]]:
    """forward: B·(S/cp)·hidden [compute dtype]; backward: cp × that = B·S·hidden."""
    local = batch * (seq // cp) * shape["hidden"]
    return {"forward": [("hidden states", local, COMPUTE)], "backward": [("hidden states", cp * local, COMPUTE)]}


def total_bytes(collectives: list[tuple[str, int, str]]) -> int:
    return sum(n * DTYPE_BYTES[dtype] for _, n, dtype in collectives)


# ---------------------------------------------------------------- measurement (workers)

_TORCH_DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64"}


def _profile_collectives(fn) -> list[tuple[str, int, str]]:
    """(event name, elements, dtype) of every gloo collective `fn` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    rows = []
    for event in prof.events():
        if event.name.startswith("gloo:"):
            shapes = [s for s in event.input_shapes if s]
            dtypes = [d for s, d in zip(event.input_shapes, event.input_dtypes or [""] * len(event.input_shapes)) if s]
            numel = sum(int(torch.Size(s).numel()) for s in shapes)
            kinds = {_TORCH_DTYPES.get(d, d) for d in dtypes}
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

        from qwen35_accel.parallel.context_parallel.collectives import (
            all_gather_with_grad,
        )
        from qwen35_accel.parallel.context_parallel.layout import (
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
    from qwen35_accel.parallel.context_parallel.layout import shard_sequence
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


# ---------------------------------------------------------------- report (parent)


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _check(measured: list[list], formula: list[tuple[str, int, str]], measure_dtype: str) -> tuple[bool, int]:
    """Elements per collective must match (as a multiset); returns (ok, bytes at the assumed dtypes).

    Measured in the compute dtype (bf16), each collective's measured dtype must also be
    the formula's, so measured bytes are exactly the formula's bytes.
    """
    got = sorted(n for _, n, _ in measured)
    want = sorted(n for _, n, _ in formula)
    ok = got == want
    if ok and measure_dtype == COMPUTE:
        ok = sorted((n, d) for _, n, d in measured) == sorted((n, d) for _, n, d in formula)
    # Bytes: measured elements priced at the dtype of the formula's collective of that size.
    price = {n: DTYPE_BYTES[d] for _, n, d in formula}
    return ok, sum(n * price.get(n, 0) for _, n, _ in measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure-seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--cp", type=int, default=2, help="cp size of the measured world and of the computed tables")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--measure-dtype", choices=["bf16", "fp32"], default="bf16",
                        help="dtype of the measured layer (fp32: elements checked, bytes priced at the assumed dtypes)")
    parser.add_argument("--max-seq", type=int, default=128 * 1024)
    _report.add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.measure_seqs = [32, 64]
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
                    ok, nbytes = _check(measured, formulas[approach][direction], args.measure_dtype)
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

    lines.append("\n## Formulas (bytes one rank contributes per GatedDeltaNet layer)\n")
    lines.append(
        "S sequence, cp context-parallel size, B batch, Hk/Hv linear key/value heads, Dk/Dv key/value head dims, "
        "K conv kernel, conv_dim = 2·Hk·Dk + Hv·Dv; c = compute dtype bytes (bf16: 2); f = 4 (fp32 summaries).\n"
    )
    lines.append("- ours fwd = c·2·B·conv_dim·min(S/(2cp), K−1) + f·2·B·Hv·Dk·(Dk+Dv)  (constant in S)")
    lines.append("- ours bwd = cp × ours fwd")
    lines.append("- all-gather fwd = c·B·(S/cp)·hidden")
    lines.append("- all-gather bwd = cp × all-gather fwd = c·B·S·hidden")
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
            of, ob = total_bytes(o["forward"]), total_bytes(o["backward"])
            af, ab = total_bytes(a["forward"]), total_bytes(a["backward"])
            computed[name]["ours"].append(of + ob)
            computed[name]["allgather"].append(af + ab)
            lines.append(
                f"| {seq} | {_fmt_bytes(of)} | {_fmt_bytes(ob)} | {_fmt_bytes(of + ob)} | {_fmt_bytes(af)} | {_fmt_bytes(ab)} | "
                f"{_fmt_bytes(af + ab)} | {(af + ab) / (of + ob):.2f} |"
            )
        # Break-even: all-gather total = ours total.
        ours_total = computed[name]["ours"][-1]
        per_token = (1 + args.cp) * DTYPE_BYTES[COMPUTE] * args.batch * shape["hidden"] / args.cp
        lines.append(f"\nBreak-even at S ≈ {ours_total / per_token:.0f} tokens: below it the all-gather approach moves fewer bytes.")

    table = "\n".join(lines)
    print(table)
    if failures:
        print("\nFORMULA MISMATCH:\n" + "\n".join(failures), file=sys.stderr)

    folder = _report.results_dir(args)
    if folder is not None:
        _plot(seqs, computed, measured_points, args, folder)
        run.write(folder, "cp_comm.md", "GatedDeltaNet context-parallel traffic per rank per layer",
                  f"Collectives: gloo, 1 thread per rank.\n\n{table}\n\n![bytes vs sequence](cp_comm.png)\n"
                  + ("\n**FORMULA MISMATCH** (see stderr of the run)\n" if failures else ""))
    if failures:
        sys.exit(1)


def _plot(seqs, computed, measured_points, args, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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


if __name__ == "__main__":
    main()
