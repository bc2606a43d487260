"""GatedDeltaNet layer under tensor parallelism: time and activation memory per rank.

    python benchmarks/tp_step.py [--tp 2] [--seq 4096] [--steps 10] [--smoke]

- ours: `apply_tensor_parallel` (head-parallel: each rank runs num_value_heads / tp heads
  of the recurrence, one all-reduce after `out_proj`);
- Transformers' plan (`base_model_tp_plan`: `colwise_gather_output` on every GatedDeltaNet
  projection): every rank gathers the projections and runs the whole layer. Timed here as
  the unsplit layer on each rank, without the gathers: a lower bound of that plan's cost,
  so the ratio below is conservative.
Both layers live in the same tp ranks (gloo, 1 thread each) and their steps alternate;
forward + backward of one layer on [1, seq, hidden]. Activation memory is the bytes of
tensors saved for backward (deduplicated by storage). Prints a markdown table with the
medians and the ratios ours / Transformers' plan, and writes it to
`benchmarks/results/tp_step.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import _report
from qwen35_accel.testing.saved_tensors import saved_storage_bytes

SHAPE = dict(  # a GatedDeltaNet layer of 4B-like proportions, scaled to run on CPUs
    hidden_size=1024, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
    linear_value_head_dim=64, num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=2048,
    num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=256,
)
SMOKE_SHAPE = {**SHAPE, **dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=16, num_attention_heads=4, head_dim=16, intermediate_size=128)}


def _worker(rank: int, world: int, seq: int, steps: int, shape: dict, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.parallel.tensor_parallel import apply_tensor_parallel
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    ours_model = build_tiny_causal_lm(seed=0, **shape)
    install_fp32_gate(ours_model)
    apply_tensor_parallel(ours_model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    full_model = build_tiny_causal_lm(seed=0, **shape)
    ours, full = ours_model.model.layers[0].linear_attn, full_model.model.layers[0].linear_attn
    hidden = torch.randn(1, seq, shape["hidden_size"], generator=torch.Generator().manual_seed(0))

    def step(layer) -> None:
        x = hidden.clone().requires_grad_()
        layer(x).sum().backward()

    memory = {}
    for name, layer in (("ours", ours), ("transformers_plan", full)):
        x = hidden.clone().requires_grad_()
        holder: dict = {}
        memory[name] = saved_storage_bytes(lambda layer=layer, x=x: holder.update(y=layer(x)))[1]
        holder["y"].sum().backward()
    times: dict[str, list[float]] = {"ours": [], "transformers_plan": []}
    warmup = 1 if steps < 5 else 2
    for i in range(steps + warmup):
        for name, layer in (("ours", ours), ("transformers_plan", full)):
            dist.barrier()
            started = time.perf_counter()
            step(layer)
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - started)
    if rank == 0:
        out.update(memory=memory, times=times, heads=(ours.num_v_heads, full.num_v_heads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    _report.add_arguments(parser)
    args = parser.parse_args()
    shape = SHAPE
    if args.smoke:
        args.seq, args.steps, shape = 64, 2, SMOKE_SHAPE
    run = _report.Run()
    result = _report.world_json(_record, args.tp, args.seq, args.steps, shape)
    ours_t, plan_t = (statistics.median(result["times"][k]) for k in ("ours", "transformers_plan"))
    paired = statistics.median(a / b for a, b in zip(result["times"]["ours"], result["times"]["transformers_plan"]))
    mem = result["memory"]
    heads = result["heads"]
    table = "\n".join([
        f"GatedDeltaNet layer, tp {args.tp}, seq {args.seq}, hidden {shape['hidden_size']}, {args.steps} timed steps each "
        f"(alternating), value heads per rank: ours {heads[0]}, Transformers' plan {heads[1]}\n",
        "| per rank | ours (head-parallel) | Transformers' plan (lower bound) | ratio |",
        "|---|---|---|---|",
        f"| step time, median | {ours_t * 1e3:.1f} ms | {plan_t * 1e3:.1f} ms | {paired:.2f} (median of paired steps) |",
        f"| activation memory | {mem['ours'] / 2**20:.1f} MiB | {mem['transformers_plan'] / 2**20:.1f} MiB | "
        f"{mem['ours'] / mem['transformers_plan']:.2f} |",
    ])
    print(table)
    run.write(_report.results_dir(args), "tp_step.md", "GatedDeltaNet under tensor parallelism: time and activation memory per rank", table)


def _record(rank: int, world: int, seq: int, steps: int, shape: dict, path: str) -> None:
    out: dict = {}
    _worker(rank, world, seq, steps, shape, out)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
