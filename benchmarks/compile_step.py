"""torch.compile's saving per training step: one process against the plugin's layouts, side by side.

    python benchmarks/compile_step.py [--steps 60] [--warmup 3] [--seq 512] [--backend inductor] [--smoke]

Three worlds run one after the other, each on the same global batch (2 rows of `--seq` tokens):
- one process: the unmodified Transformers model, eager and `torch.compile(model)` (whole);
- FSDP2, 2 ranks (1 row each): `PARALLELIZER.apply`, eager and compiled per decoder layer as the
  Accelerate integration compiles it (`parallel.regional_compile`);
- CP 2, 2 ranks (both rows, each rank half of every row): the same, under context parallelism.
In each world the eager and the compiled model take turns step by step (forward + backward +
SGD; barrier before and after on 2 ranks, so a step's time is its slowest rank's); one thread
per process. Reported: median step times, the time compile saves per step (eager − compiled,
median of the paired differences), that saving as a share of one process's (the goal: at least
0.4 under FSDP2 and CP 2, each rank doing half the work: ideal 0.5), and the graph breaks of a
compiled step. Appended to `benchmarks/results/compile_step.md` with the run's header.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import _report
from fsdp_step import SHAPE, SMOKE_SHAPE


def _steps(models: dict, optimizers: dict, batch: dict, warmup: int, steps: int, barrier) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in models}
    names = list(models)
    for step in range(warmup + steps):
        for name in names if step % 2 == 0 else names[::-1]:
            barrier()
            start = time.perf_counter()
            models[name](**batch).loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            barrier()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def _breaks(model, batch: dict) -> int:
    from torch._dynamo.utils import counters

    counters.clear()
    model(**batch).loss.backward()
    return sum(counters["graph_break"].values())


def _one_process(seq: int, warmup: int, steps: int, shape: dict, backend: str) -> dict:
    import torch

    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    torch.set_num_threads(1)
    eager = build_tiny_causal_lm(seed=0, **shape)
    compiled = torch.compile(build_tiny_causal_lm(seed=0, **shape), backend=backend)
    models = {"eager": eager, "compiled": compiled}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    batch = random_batch(2, seq, shape["vocab_size"], seed=0)
    times = _steps(models, optimizers, batch, warmup, steps, lambda: None)
    return {"times": times, "breaks": _breaks(compiled, batch)}


def _worker(rank: int, world: int, cp: int, seq: int, warmup: int, steps: int, shape: dict, backend: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.model.detect import qwen35_parts
    from qwen35_accel.parallel.regional_compile import compile_layer_regions
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, world // cp, cp, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    eager, compiled = (PARALLELIZER.apply(build_tiny_causal_lm(seed=0, **shape), mesh) for _ in range(2))
    regions = compile_layer_regions(qwen35_parts(compiled), context_parallel=cp > 1, backend=backend)
    models = {"eager": eager, "compiled": compiled}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    rows = 2 * cp // world  # the global batch is 2 rows in every world
    batch = random_batch(rows, seq, shape["vocab_size"], seed=rank // cp)
    if cp > 1:
        batch = shard_batch(batch, mesh["cp"])
    times = _steps(models, optimizers, batch, warmup, steps, dist.barrier)
    breaks = _breaks(compiled, batch)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "breaks": breaks, "regions": regions}))


def _saving(times: dict[str, list[float]]) -> float:
    return statistics.median(e - c for e, c in zip(times["eager"], times["compiled"]))


def report(results: dict[str, dict], seq: int, shape: dict, backend: str) -> str:
    reference = _saving(results["one process"]["times"])
    steps = len(results["one process"]["times"]["eager"])
    lines = [
        f"backend {backend}, 2 rows of {seq} tokens per step in every world, {steps} measured steps each (taking turns), "
        f"fp32, 1 thread per process; {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}\n",
        "| world | compiled | eager (ms) | compiled (ms) | saved per step (ms) | share of one process's saving | graph breaks |",
        "|---|---|---|---|---|---|---|",
    ]
    for world, result in results.items():
        med = {k: 1e3 * statistics.median(v) for k, v in result["times"].items()}
        saved = _saving(result["times"])
        share = "1" if world == "one process" else (f"{saved / reference:.2f}" if reference > 0 else "n/a (one process saved nothing)")
        lines.append(f"| {world} | {result.get('regions', 'the whole model')} | {med['eager']:.1f} | {med['compiled']:.1f} | "
                     f"{1e3 * saved:.1f} | {share} | {result['breaks']} |")
    lines.append("\n(goal: a share of at least 0.4 under FSDP2 and CP 2, each rank doing half the work: ideal 0.5)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)  # savings of ~7 % of a step: fewer steps leave the share noisy
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--backend", default="inductor")
    _report.add_arguments(parser)
    args = parser.parse_args()
    shape = SHAPE
    if args.smoke:
        args.steps, args.warmup, args.seq, args.backend, shape = 2, 1, 32, "aot_eager", SMOKE_SHAPE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from qwen35_accel.testing.local_world import run_local_world

    run = _report.Run()
    results = {"one process": _one_process(args.seq, args.warmup, args.steps, shape, args.backend)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cp in (("FSDP2, 2 ranks", 1), ("CP 2, 2 ranks", 2)):
            path = os.path.join(tmp, f"cp{cp}.json")
            run_local_world(_worker, 2, cp, args.seq, args.warmup, args.steps, shape, args.backend, path)
            results[name] = json.loads(Path(path).read_text())
    table = report(results, args.seq, shape, args.backend)
    print(table)
    run.write(_report.results_dir(args), "compile_step.md", "torch.compile's saving per step: one process against FSDP2 and CP 2",
              table, append=True)


if __name__ == "__main__":
    main()
