"""Demo: FSDP2 training of a tiny dense Qwen3.5 on local CPU processes (gloo).

    python -m qwen35_accel.demo [--world-size 2] [--steps 30] [--precision bf16|fp32]
                                [--activation-checkpointing]

Each rank gets its own batches of a synthetic task (every token is the previous one
plus a per-row stride, modulo the vocabulary), so the loss visibly falls in a few dozen
steps. Prints the FSDP2 units of the first decoder layers, then the global loss per step.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def _batch(vocab: int, rows: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(1, vocab, (rows, 1), generator=gen)
    stride = torch.randint(1, 4, (rows, 1), generator=gen)
    ids = 1 + (start + stride * torch.arange(seq)) % (vocab - 1)
    return {"input_ids": ids, "labels": ids.clone()}


def _train(rank: int, world: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.fsdp import describe_units
    from qwen35_accel.model.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(seed=0, num_hidden_layers=6)
    policy = None
    if args.precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    PARALLELIZER.apply(model, mesh, mp_policy=policy, activation_checkpointing=args.activation_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    if rank == 0:
        units = describe_units(model)
        print(f"world size {world}, mesh {mesh}, precision {args.precision}, {len(units)} FSDP2 units; the first layers':")
        for row in units:
            if row["unit"].startswith(("model.layers.0", "model.layers.2")):
                print(f"  {row['unit']:<40} {row['params']:>6} params  storage {row['storage']:<8} compute {row['compute']}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = _batch(model.config.vocab_size, args.rows, args.seq, seed=step * world + rank)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        if rank == 0 and (step == 1 or step % max(1, args.steps // 10) == 0 or step == args.steps):
            print(f"step {step:>3}/{args.steps}  loss {global_loss.item():.4f}  ({time.perf_counter() - start:.1f}s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--activation-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from qwen35_accel.local_world import run_local_world

    run_local_world(_train, args.world_size, args)


if __name__ == "__main__":
    main()
