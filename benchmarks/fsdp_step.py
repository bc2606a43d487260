"""Training step time: qwen35_accel's dtype-uniform units vs a single-policy per-layer wrap.

    python benchmarks/fsdp_step.py [--world-size 2] [--steps 20] [--seq 512] [--smoke]

All models live in the same processes and take turns step by step, in an order that
reverses every step (A B C D, D C B A, …), so machine noise and position in the round
hit them alike. All use a bf16 compute / fp32 reduce policy on fp32 master weights:
- qwen35_accel: `PARALLELIZER.apply` (per decoder layer: an fp32 gate-holder unit + the
  layer; the default);
- qwen35_accel (model holder unit): `fp32_holder_units="model"` (one fp32 unit for all
  gate holders);
- baseline: Accelerate's shape: everything fp32, `fully_shard` per decoder layer, the
  embedding, tail [norm, lm_head], root; one bf16 policy (gate computed from bf16);
  FSDP2's default collective schedule. The target (≤ 1.05) is against this.
- baseline, same schedule: the baseline's units with qwen35_accel's collective schedule
  (explicit prefetch chain embedding → layers → tail, asynchronous all-gathers on CPU).
  The ratio to it is the cost of the gate-holder units alone.
Reports the median step time of each (rank 0) and, per variant of ours, the median of
its paired step ratios to each baseline. Each run is appended to
`benchmarks/results/fsdp_step.md` as a section of its own (header: date, versions, load),
so ranges over several runs can be read off the runs' tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import _report

SHAPE = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
    linear_value_head_dim=32, vocab_size=2048,
)
SMOKE_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, vocab_size=256,
)


def _worker(rank: int, world: int, steps: int, seq: int, warmup: int, shape: dict, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.fsdp import set_async_unshard_on_cpu, set_layer_prefetch
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    ours = PARALLELIZER.apply(build_tiny_causal_lm(seed=0, **shape), mesh, mp_policy=policy)
    shared = PARALLELIZER.apply(build_tiny_causal_lm(seed=0, **shape), mesh, mp_policy=policy, fp32_holder_units="model")

    def accelerate_shape():
        model = build_tiny_causal_lm(seed=0, **shape)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=policy)
        fully_shard([model.model.norm, model.lm_head], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    baseline = accelerate_shape()
    same_schedule = accelerate_shape()
    set_layer_prefetch(
        [[layer] for layer in same_schedule.model.layers], forward_depth=1, backward_depth=2,
        before=same_schedule.model.embed_tokens, after=same_schedule.lm_head,
    )
    set_async_unshard_on_cpu(same_schedule, mesh.device_type)

    models = {
        "qwen35_accel": ours,
        "qwen35_accel (model holder unit)": shared,
        "baseline": baseline,
        "baseline, same schedule": same_schedule,
    }
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    batch = random_batch(1, seq, shape["vocab_size"], seed=rank)
    names = list(models)
    for step in range(warmup + steps):
        for name in names if step % 2 == 0 else names[::-1]:
            model = models[name]
            dist.barrier()
            start = time.perf_counter()
            model(**batch).loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            dist.barrier()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        Path(out_path).write_text(json.dumps(times))


def report(times: dict[str, list[float]], world: int, seq: int, shape: dict) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    steps = len(times["baseline"])
    lines = [
        f"world {world}, seq {seq}, {steps} measured steps each (taking turns), bf16 compute / fp32 reduce; "
        f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}\n",
        "| wrap | median step (ms) | paired ratio to baseline | paired ratio to baseline, same schedule |",
        "|---|---|---|---|",
    ]
    for k, v in med.items():
        # Paired: each step against the baseline's step of the same round.
        paired = [statistics.median(a / b for a, b in zip(times[k], times[ref])) for ref in ("baseline", "baseline, same schedule")]
        lines.append(f"| {k} | {1e3 * v:.1f} | {paired[0]:.3f} | {paired[1]:.3f} |")
    lines.append("\n(target <= 1.05 against the baseline)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq", type=int, default=512)
    _report.add_arguments(parser)
    args = parser.parse_args()
    shape = SHAPE
    if args.smoke:
        args.steps, args.warmup, args.seq, shape = 2, 1, 64, SMOKE_SHAPE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from qwen35_accel.testing.local_world import run_local_world

    run = _report.Run()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "fsdp_step.json")
        run_local_world(_worker, args.world_size, args.steps, args.seq, args.warmup, shape, path)
        times = json.loads(Path(path).read_text())
    table = report(times, args.world_size, args.seq, shape)
    print(table)
    run.write(_report.results_dir(args), "fsdp_step.md", "Training step time: qwen35_accel vs a single-policy per-layer wrap",
              table, append=True)


if __name__ == "__main__":
    main()
