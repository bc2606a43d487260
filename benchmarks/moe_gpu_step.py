"""Qwen3.5-MoE training step on the GPUs of one machine: ep 1 against ep = every GPU, side by side.

    python benchmarks/moe_gpu_step.py [--layers 4] [--seq 8192] [--steps 3] [--warmup 1] [--smoke]

A 35B-A3B-shaped model (Transformers' default `Qwen3_5MoeTextConfig`: hidden 2048, 256 experts,
top 8, expert width 512, a shared expert, vocab 248,320) cut to `--layers` decoder layers (three
GatedDeltaNet layers to one attention layer), random weights, no download. Every GPU of the
machine is a rank (the script starts `torchrun` itself; under `torchrun` it runs as launched),
NCCL, one row of `--seq` tokens per rank, `PARALLELIZER.apply` with FSDP2 over all ranks, bf16
compute on fp32 masters, activation checkpointing, SGD (no optimizer state). Configurations:
ep 1 (every expert gathered per layer) and ep = world (each rank its `num_experts / world`
experts, tokens by all-to-all). Per configuration: tokens/s over all ranks (the median step),
the peak memory of the most loaded rank (`torch.cuda.max_memory_allocated`), what `plan`'s memory
model predicts for it, and the first step's loss (the same model and batch: equal across
configurations up to bf16 rounding). One GPU runs ep 1 only (ep needs two ranks).

`--smoke`: a tiny fp32 MoE on 2 CPU ranks over gloo, both configurations, whose first losses must
agree to fp32 rounding (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _report
from gpu_step import predicted_bytes

SMOKE_SHAPE = dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=256)


def moe_config(layers: int, smoke: bool):
    """Transformers' default Qwen3.5-MoE text config (35B-A3B's shape) with `layers` decoder layers."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    config = Qwen3_5MoeTextConfig(num_hidden_layers=layers, layer_types=types, tie_word_embeddings=False,
                                  **(SMOKE_SHAPE if smoke else {}))
    config._attn_implementation = "sdpa"
    return config


def _measure(rank: int, world: int, args: argparse.Namespace, device_type: str) -> list[dict]:
    """Every configuration on this rank: [{ep, times, peak, first_loss}] (peak None on CPU)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    from qwen35_accel import PARALLELIZER

    cuda = device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device_type, (1, world, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    config = moe_config(args.layers, args.smoke)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=generator).to(device)
    results = []
    for ep in (1, world) if world > 1 else (1,):
        torch.manual_seed(0)  # the same weights on every rank and in every configuration
        with torch.device(device):
            model = Qwen3_5MoeForCausalLM(config)
        PARALLELIZER.apply(model, mesh, ep=ep, mp_policy=policy, activation_checkpointing=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times, first = [], None
        for i in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if first is None:
                first = loss.item()
            if i >= args.warmup:
                times.append(time.perf_counter() - started)
        results.append(dict(ep=ep, times=times, first_loss=first,
                            peak=torch.cuda.max_memory_allocated() if cuda else None))
        print(f"rank {rank}: ep {ep} done, median step {statistics.median(times):.3f} s", flush=True)
        del model, optimizer, loss
    return results


def _worker(rank: int, world: int, args: argparse.Namespace, device_type: str, path: str) -> None:
    import torch.distributed as dist

    gathered: list = [None] * world
    dist.all_gather_object(gathered, _measure(rank, world, args, device_type))
    if rank == 0:
        Path(path).write_text(json.dumps(gathered))


def _launched_main(args: argparse.Namespace) -> None:
    """Under torchrun (one process per GPU): NCCL, the results to `--out-json`."""
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        _worker(dist.get_rank(), dist.get_world_size(), args, "cuda", args.out_json)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192, help="tokens per rank (one row)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=None, help="ranks on this machine (default: every GPU)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    parser.add_argument("--out-json", default=None, help=argparse.SUPPRESS)  # set when this script starts torchrun
    _report.add_arguments(parser)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        _launched_main(args)
        return
    import torch

    from qwen35_accel.memory import Parallel

    run = _report.Run()
    if args.smoke:
        args.layers, args.seq, args.steps, args.warmup = 4, 64, 2, 1
        device_type, world = "cpu", 2
        ranks = _report.world_json(_worker, world, args, device_type)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("moe_gpu_step.py measures GPUs; on a CPU machine run it with --smoke")
        device_type, world = "cuda", args.gpus or torch.cuda.device_count()
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ranks.json")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                       sys.argv[0], *sys.argv[1:], "--out-json", out]
            subprocess.run(command, check=True, timeout=args.timeout)
            ranks = json.loads(Path(out).read_text())
    config = moe_config(args.layers, args.smoke)
    gib = 2**30
    lines = [f"Qwen3.5-MoE, 35B-A3B's shape{' (smoke: tiny)' if args.smoke else ''}, {args.layers} layers, "
             f"{config.num_experts} experts, top {config.num_experts_per_tok}, world {world} ({device_type}), one row of "
             f"{args.seq} tokens per rank, {'fp32' if args.smoke else 'bf16 compute on fp32 masters'}, checkpointing, SGD; "
             f"median of {args.steps} steps after {args.warmup} warm-up\n",
             "| config | tokens/s (all ranks) | vs ep 1 | peak memory, most loaded rank (GiB) | plan predicts (GiB) | first loss |",
             "|---|---|---|---|---|---|"]
    baseline = None
    for i, result in enumerate(ranks[0]):
        ep = result["ep"]
        step = max(statistics.median(r[i]["times"]) for r in ranks)  # the slowest rank's median
        tokens = world * args.seq / step
        baseline = baseline or tokens
        peak = max((r[i]["peak"] or 0) for r in ranks)
        predicted = predicted_bytes(config, args.seq, world, device_type, Parallel(dp_shard=world, ep=ep))
        lines.append(f"| ep {ep} | {tokens:,.0f} | {tokens / baseline:.2f} | {peak / gib:.2f} | {predicted / gib:.2f} | "
                     f"{result['first_loss']:.6f} |" if peak else
                     f"| ep {ep} | {tokens:,.0f} | {tokens / baseline:.2f} | n/a (CPU) | {predicted / gib:.4f} | "
                     f"{result['first_loss']:.6f} |")
    table = "\n".join(lines)
    print(table)
    run.write(_report.results_dir(args), "moe_gpu_step.md", "Qwen3.5-MoE on GPUs: ep 1 against ep = every GPU", table)


if __name__ == "__main__":
    main()
