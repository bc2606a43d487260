"""The vision placeholder's cost: a text-only VLM training step with and without it, FSDP2.

    python benchmarks/vlm_placeholder_step.py [--world-size 2] [--steps 10] [--seq 256] [--smoke]

A `Qwen3_5ForConditionalGeneration` (text: hidden 256, 6 layers as fsdp_step.py; vision
tower: hidden 128, 4 blocks), trainable tower, fp32, `PARALLELIZER.apply` over a gloo world
(each vision block an FSDP2 unit). Every rank's batch is text only, so both variants keep
the ranks' collectives matched and can be timed in the same processes, taking turns in an
order that reverses every step:
- placeholder: as installed (the tower runs on one zero image of 2 x 2 patches, one merged
  token, added times zero: its blocks' all-gathers, its forward/backward and reduce-scatters);
- none: the same model with the hook removed (the tower skipped; a mixed batch would then
  abort, see parallel/vision_placeholder.py).
Reports the median step time of each (rank 0), the median of the paired ratios
placeholder / none, and the tower's share of the parameters (what the placeholder's
collectives move). Runs are appended to `benchmarks/results/vlm_placeholder_step.md`.
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
from fsdp_step import SHAPE, SMOKE_SHAPE

VISION = dict(hidden_size=128, intermediate_size=256, num_heads=4, depth=4)
SMOKE_VISION = dict(hidden_size=16, intermediate_size=32, num_heads=2, depth=2)
VARIANTS = ("placeholder", "none")


def build_vlm(shape: dict, vision: dict) -> torch.nn.Module:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from qwen35_accel.testing.tiny import randomize_for_parity, tiny_vlm_config

    config = tiny_vlm_config(**shape)
    for key, value in vision.items():
        setattr(config.vision_config, key, value)
    torch.manual_seed(0)
    return randomize_for_parity(hf.Qwen3_5ForConditionalGeneration(config), seed=0)


def _worker(rank: int, world: int, steps: int, warmup: int, seq: int, shape: dict, vision: dict, out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.vision_placeholder import PLACEHOLDER_HOOK_ATTR
    from qwen35_accel.testing.tiny import mixed_vlm_batch

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    models = {name: PARALLELIZER.apply(build_vlm(shape, vision), mesh) for name in VARIANTS}
    getattr(models["none"].model, PLACEHOLDER_HOOK_ATTR).remove()
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for step in range(warmup + steps):
        batch = mixed_vlm_batch(models["none"].config, [None, None], seq, seed=1000 * step + rank)
        for name in VARIANTS if step % 2 == 0 else reversed(VARIANTS):
            torch.distributed.barrier()
            start = time.perf_counter()
            models[name](**batch).loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            torch.distributed.barrier()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        Path(out_path).write_text(json.dumps(times))


def main() -> None:
    from qwen35_accel.testing.local_world import run_local_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    _report.add_arguments(parser)
    args = parser.parse_args()
    shape, vision = (SMOKE_SHAPE, SMOKE_VISION) if args.smoke else (SHAPE, VISION)
    if args.smoke:
        args.steps, args.warmup, args.seq = 2, 0, 32
    run = _report.Run()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        run_local_world(_worker, args.world_size, args.steps, args.warmup, args.seq, shape, vision, out, threads_per_rank=1)
        times = json.loads(Path(out).read_text())
    model = build_vlm(shape, vision)
    share = sum(p.numel() for p in model.model.visual.parameters()) / sum(p.numel() for p in model.parameters())
    medians = {name: statistics.median(times[name]) for name in VARIANTS}
    ratio = statistics.median(p / n for p, n in zip(times["placeholder"], times["none"]))
    text = ", ".join(f"{k} {v}" for k, v in shape.items() if k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    tower = ", ".join(f"{k} {v}" for k, v in vision.items())
    table = "\n".join([
        f"World {args.world_size} (gloo, 1 thread per rank), fp32, trainable tower; text: {text}; vision: {tower}; "
        f"2 text-only rows of {args.seq} tokens per rank; {args.steps} timed steps after {args.warmup} warm-up. The tower "
        f"holds {share:.1%} of the parameters: the placeholder's cost is mostly gathering and reducing them.",
        "",
        "| text-only step | median s (rank 0) |",
        "|---|---|",
        *[f"| {name} | {medians[name]:.4f} |" for name in VARIANTS],
        "",
        f"placeholder / none (median of paired steps): {ratio:.3f}x",
    ])
    print(table)
    run.write(_report.results_dir(args), "vlm_placeholder_step.md", "The vision placeholder's cost on a text-only step", table,
              append=True)


if __name__ == "__main__":
    main()
