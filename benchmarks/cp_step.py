"""Step time (forward + backward) per rank under context parallelism: cp 2 vs cp 1.

    python benchmarks/cp_step.py [--seq 4096] [--rounds 3] [--warmup 1] [--steps 2] [--smoke]

The same tiny-but-wide dense Qwen3.5 as cp_memory.py (hidden 512, 4 layers: 3
GatedDeltaNet + 1 full attention, fp32, sdpa) under `PARALLELIZER.apply`, 1 thread per rank:
- cp 1: world 1, mesh ("dp_shard_cp",), the whole sequence;
- cp 2: world 2, mesh ("dp_shard", "cp") = (1, 2) + flattened "dp_shard_cp", each rank
  `shard_batch(batch, mesh["cp"])` (FSDP2 over the 2 ranks, CP collectives included).
The configurations alternate: a cp 1 world, then a cp 2 world, `--rounds` times, so
machine drift hits both alike. Each world runs `--warmup` untimed steps, then `--steps`
timed ones (barrier before each step; a rank's time ends when its backward returns; the
world's step time is the slowest rank's). Reported: medians over all timed steps, the ratio
cp 2 / cp 1 (ideal 0.5: each rank does half the work), and per round. In the last round
each world profiles one extra step to show how much of it is `aten::fill_`: on CPU the
Transformers reference GatedDeltaNet kernel (`torch_chunk_gated_delta_rule`, no FLA) spends
time that grows quadratically with the per-rank sequence in its backward, which flatters
CP (each rank runs two chunks of S/(2cp) tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _report
from cp_memory import SMOKE_SHAPE, WIDE_SHAPE, build_parallel_model, make_batch, shape_note


def _worker(
    rank: int, world: int, cp: int, seq: int, warmup: int, steps: int, profile_step: bool, shape: dict[str, Any], out_path: str
) -> None:
    import torch.distributed as dist

    model, mesh = build_parallel_model(cp, seq, shape)
    batch = make_batch(cp, seq, mesh, shape)

    def step() -> tuple[float, float, float]:
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = model(**batch).loss
        loss.backward()
        return time.perf_counter() - start, time.process_time() - cpu_start, float(loss.detach())

    times, cpu, loss = [], [], None
    for i in range(warmup + steps):
        elapsed, cpu_s, loss = step()
        if i >= warmup:
            times.append(elapsed)
            cpu.append(cpu_s)
    profiled = None
    if profile_step:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            elapsed, _, _ = step()
        fill = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "aten::fill_") / 1e6
        profiled = {"step_s": elapsed, "fill_s": fill}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "times": times, "cpu": cpu, "loss": loss, "profiled": profiled})
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out-name", default="cp_step", help="results file stem (in --results-dir)")
    _report.add_arguments(parser)
    args = parser.parse_args()
    shape = WIDE_SHAPE
    if args.smoke:
        args.seq, args.rounds, args.warmup, args.steps, shape = 128, 1, 0, 1, SMOKE_SHAPE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from qwen35_accel.testing.local_world import run_local_world

    configs = (1, args.cp)
    run = _report.Run()
    rounds: list[dict[int, list[dict]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            this_round = {}
            for cp in configs:
                path = os.path.join(tmp, f"r{r}_cp{cp}.json")
                run_local_world(
                    _worker, cp, cp, args.seq, args.warmup, args.steps, r == args.rounds - 1, shape, path, threads_per_rank=1
                )
                this_round[cp] = json.loads(Path(path).read_text())
            rounds.append(this_round)

    all_steps = {cp: [t for rd in rounds for t in _report.slowest_rank_steps(rd[cp])] for cp in configs}
    med = {cp: statistics.median(v) for cp, v in all_steps.items()}
    ratio = med[args.cp] / med[1]
    lines = [
        (
            f"seq {args.seq} tokens, batch 1, forward + backward, 1 thread per rank, {args.rounds} rounds x "
            f"(cp 1 world, cp {args.cp} world), {args.warmup} warmup + {args.steps} timed steps per world; {shape_note(shape)}.\n"
        ),
        "| config | rank | median step (s) | median CPU time / wall time | timed steps | loss |",
        "|---|---|---|---|---|---|",
    ]
    for cp in configs:
        for rank in range(cp):
            times = [t for rd in rounds for t in rd[cp][rank]["times"]]
            busy = [c / t for rd in rounds for c, t in zip(rd[cp][rank]["cpu"], rd[cp][rank]["times"])]
            lines.append(
                f"| cp {cp} (world {cp}) | {rank} | {statistics.median(times):.2f} | {statistics.median(busy):.2f} | {len(times)} | "
                f"{rounds[-1][cp][rank]['loss']:.6f} |"
            )
        lines.append(f"| cp {cp} (world {cp}) | slowest rank per step | **{med[cp]:.2f}** | | {len(all_steps[cp])} | |")
    lines.append(
        f"\n**Step time per rank, cp {args.cp} / cp 1 (medians): {ratio:.3f}** (ideal {1 / args.cp:.3f}: each rank "
        f"holds 1/{args.cp} of the tokens; > ideal = CP overhead, < ideal = the cp 1 run pays super-linear costs)."
    )
    per_round = [statistics.median(_report.slowest_rank_steps(rd[args.cp])) / statistics.median(_report.slowest_rank_steps(rd[1])) for rd in rounds]
    lines.append("Per round (median cp 2 / median cp 1): " + ", ".join(f"{x:.3f}" for x in per_round) + ".")
    cpu_steps = {cp: [max(cs) for rd in rounds for cs in zip(*(res["cpu"] for res in rd[cp]))] for cp in configs}
    cpu_med = {cp: statistics.median(v) for cp, v in cpu_steps.items()}
    lines.append(
        f"CPU time per rank (process CPU seconds per step, busiest rank), cp {args.cp} / cp 1 (medians): "
        f"{cpu_med[args.cp] / cpu_med[1]:.3f} ({cpu_med[args.cp]:.2f} s / {cpu_med[1]:.2f} s); less sensitive to other "
        "load on the machine, blind to time spent waiting in collectives."
    )
    utilisation = {
        cp: statistics.median(c / t for rd in rounds for res in rd[cp] for c, t in zip(res["cpu"], res["times"])) for cp in configs
    }
    # Steps where every rank had a core to itself (CPU time / wall time >= 0.9 on each rank).
    clean = {
        cp: [
            max(ts)
            for rd in rounds
            for ts, cs in zip(zip(*(res["times"] for res in rd[cp])), zip(*(res["cpu"] for res in rd[cp])))
            if min(c / t for c, t in zip(cs, ts)) >= 0.9
        ]
        for cp in configs
    }
    if all(clean.values()):
        lines.append(
            f"Wall-clock medians over the steps where every rank had >= 90% of a core: cp 1 {statistics.median(clean[1]):.2f} s "
            f"({len(clean[1])} steps), cp {args.cp} {statistics.median(clean[args.cp]):.2f} s ({len(clean[args.cp])} steps), "
            f"ratio {statistics.median(clean[args.cp]) / statistics.median(clean[1]):.3f}."
        )
    else:
        lines.append("No clean steps (every rank >= 90% of a core) in " + ", ".join(f"cp {cp}" for cp in configs if not clean[cp]) + ".")
    if min(utilisation.values()) < 0.9:
        lines.append(
            "\n**WARNING: the ranks got less than 90% of a core (median CPU/wall: "
            + ", ".join(f"cp {cp} {u:.2f}" for cp, u in utilisation.items())
            + "). Other processes were competing for the cores, so the wall-clock ratio above is not trustworthy; "
            "rerun on an idle machine.**"
        )
    prof = {cp: max(res["profiled"]["fill_s"] for res in rounds[-1][cp]) for cp in configs}
    prof_step = {cp: max(res["profiled"]["step_s"] for res in rounds[-1][cp]) for cp in configs}
    without = (prof_step[args.cp] - prof[args.cp]) / (prof_step[1] - prof[1])
    lines.append(
        f"\nDiagnostic (one profiled step per world, last round, slowest rank): time in `aten::fill_` "
        f"cp 1 {prof[1]:.2f} s of {prof_step[1]:.2f} s, cp {args.cp} {prof[args.cp]:.2f} s of {prof_step[args.cp]:.2f} s; "
        f"ratio of the profiled steps without it: {without:.3f}. (The fill_ comes from the backward of the per-chunk "
        "indexing in Transformers' CPU reference GatedDeltaNet kernel and grows with the square of the per-rank sequence.)"
    )
    lines.append(
        "\nCPU time / wall time well below 1 means a rank waited (collectives) or was starved of a core; the load average "
        "before / after the run is in the header."
    )
    table = "\n".join(lines)
    print(table)

    run.write(_report.results_dir(args), f"{args.out_name}.md", f"Step time per rank: cp {args.cp} vs cp 1", table)


if __name__ == "__main__":
    main()
