"""Qwen3.5-MoE under expert parallelism: ep 2 against dp 2 (every expert gathered), side by side.

    python benchmarks/moe_step.py [--world-size 2] [--steps 10] [--seq 1024] [--smoke]

Both layouts are `PARALLELIZER.apply` on the same ranks (gloo, 1 thread each), fp32, the same
global batch (one row of `--seq` tokens per rank), AdamW; their steps alternate, the order
reversing every step. Per rank it reports:
- memory: the parameters, gradients and AdamW state each rank holds (its shards), and the
  expert weights a layer holds while it computes (dp: every expert, gathered by FSDP2; ep:
  this rank's `num_experts / ep`, never gathered with efsdp 1);
- communication per MoE layer and step: the bytes FSDP2 moves for the experts (all-gather in
  forward and backward, reduce-scatter of their gradients; counted from the shapes) against the
  bytes the all-to-alls move (counted as they run, by a dispatch mode), and what the routing
  implies for them: every (token, expert) pair there and back, in forward and in backward,
  of which the pairs whose expert lives on another rank leave the rank;
- the step time: the medians and the median of the paired ratios ep / dp.
Writes `benchmarks/results/moe_step.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import _report

SHAPE = dict(  # 35B-A3B's proportions (experts, top-k, shared expert), scaled to run on CPUs
    hidden_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
    num_hidden_layers=4, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=1024,
)
SMOKE_SHAPE = {**SHAPE, **dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                               num_experts_per_tok=2, num_attention_heads=4, head_dim=16, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=256)}


class AllToAllBytes(TorchDispatchMode):
    """The bytes handed to all-to-all collectives while active (forward and backward): token rows
    (floating point) and the per-expert counts (integers) apart."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.count_bytes = 0
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._schema.name
        if "all_to_all" in name or "alltoall" in name:
            sent = args[1] if name == "c10d::alltoall_base_" else args[0]
            size = sent.numel() * sent.element_size()
            if sent.is_floating_point():
                self.bytes += size
            else:
                self.count_bytes += size
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def _worker(rank: int, world: int, seq: int, steps: int, shape: dict, path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, random_batch

    mesh = init_device_mesh("cpu", (1, world, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    models = {}
    for name, ep in (("dp", 1), ("ep", world)):
        model = build_tiny_moe_causal_lm(seed=0, **shape)
        PARALLELIZER.apply(model, mesh, ep=ep)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    batch = random_batch(1, seq, shape["vocab_size"], seed=rank)
    routes: list[torch.Tensor] = []
    for router in (m for m in models["ep"][0].modules() if isinstance(m, Qwen3_5MoeTopKRouter)):
        router.register_forward_hook(lambda _m, _i, out: routes.append(out[2].detach()))

    def step(name: str) -> None:
        model, optimizer = models[name]
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients' buffers, to count them

    times: dict[str, list[float]] = {"dp": [], "ep": []}
    counted = AllToAllBytes()
    warmup = 1 if steps < 5 else 2
    for i in range(steps + warmup):
        for name in ("dp", "ep") if i % 2 == 0 else ("ep", "dp"):
            dist.barrier()
            started = time.perf_counter()
            if name == "ep" and i == 0:
                with counted:
                    step(name)
                first_routes = list(routes)
            else:
                step(name)
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - started)
    layers = shape["num_hidden_layers"]
    experts, top_k, hidden = shape["num_experts"], shape["num_experts_per_tok"], shape["hidden_size"]
    per_rank = experts // world
    owners = torch.cat([chosen.reshape(-1) // per_rank for chosen in first_routes[:layers]])
    leaving = int((owners != rank).sum())
    to_each = torch.bincount(owners, minlength=world)  # pairs this rank sends to each rank
    dist.all_reduce(to_each)
    received = int(to_each[rank])  # pairs every rank sends to this rank's experts
    memory = {}
    for name, (model, optimizer) in models.items():
        params = list(model.parameters())
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        experts_params = [p for n, p in model.named_parameters() if ".mlp.experts." in n]
        memory[name] = dict(params=_local_bytes(params), grads=_local_bytes([p.grad for p in params]),
                            optimizer=_local_bytes(state), experts=_local_bytes(experts_params))
    expert_bytes = 3 * shape["moe_intermediate_size"] * hidden * 4  # gate_up [2I, H] + down [H, I], fp32
    out = dict(
        times=times, memory=memory, leaving=leaving, pairs=seq * top_k * layers, received=received,
        all_to_all=dict(bytes=counted.bytes, count_bytes=counted.count_bytes, calls=counted.calls),
        gathered=dict(dp=experts * expert_bytes, ep=per_rank * expert_bytes),
        fsdp_expert_bytes=experts * expert_bytes * (world - 1) // world,  # one all-gather's or reduce-scatter's share
    )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(gathered, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    _report.add_arguments(parser)
    args = parser.parse_args()
    shape = SHAPE
    if args.smoke:
        args.seq, args.steps, shape = 64, 2, SMOKE_SHAPE
    run = _report.Run()
    ranks = _report.world_json(_worker, args.world_size, args.seq, args.steps, shape)
    world, first = args.world_size, ranks[0]
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    dp_t, ep_t = (statistics.median(first["times"][k]) for k in ("dp", "ep"))
    paired = statistics.median(e / d for e, d in zip(first["times"]["ep"], first["times"]["dp"]))
    mem = first["memory"]
    mib = 2**20

    def total(name: str) -> int:
        return mem[name]["params"] + mem[name]["grads"] + mem[name]["optimizer"]

    # The routing's count per MoE layer: the rank sends each of its pairs out and the result of each
    # pair it received back, in forward, and the same again in backward; fp32 rows of `hidden` (the
    # all-to-all hands over the pairs that stay on the rank too).
    implied = 2 * (first["pairs"] + first["received"]) * hidden * 4 / layers
    measured = first["all_to_all"]["bytes"] / layers
    leaving = statistics.mean(r["leaving"] / r["pairs"] for r in ranks)
    table = "\n".join([
        f"Qwen3.5-MoE, {layers} layers, {shape['num_experts']} experts, top {shape['num_experts_per_tok']}, hidden {hidden}, "
        f"moe intermediate {shape['moe_intermediate_size']}, world {world}, one row of {args.seq} tokens per rank, fp32, "
        f"AdamW, {args.steps} timed steps each (alternating)\n",
        "| per rank | dp (every expert gathered) | ep | ep / dp |",
        "|---|---|---|---|",
        f"| parameters + gradients + AdamW state held | {total('dp') / mib:.2f} MiB | {total('ep') / mib:.2f} MiB | "
        f"{total('ep') / total('dp'):.2f} |",
        f"| of which expert parameters held | {mem['dp']['experts'] / mib:.2f} MiB | {mem['ep']['experts'] / mib:.2f} MiB | "
        f"{mem['ep']['experts'] / mem['dp']['experts']:.2f} |",
        f"| expert weights of a layer while it computes | {first['gathered']['dp'] / mib:.2f} MiB | "
        f"{first['gathered']['ep'] / mib:.2f} MiB | {first['gathered']['ep'] / first['gathered']['dp']:.2f} |",
        f"| FSDP2 bytes for the experts per layer and step (2 all-gathers, 1 reduce-scatter) | "
        f"{3 * first['fsdp_expert_bytes'] / mib:.2f} MiB | 0 (efsdp 1) | — |",
        f"| all-to-all bytes per layer and step, counted: token rows (+ the per-expert counts) | — | {measured / mib:.2f} MiB "
        f"(+ {first['all_to_all']['count_bytes'] / layers:.0f} B) | — |",
        f"| all-to-all bytes per layer and step, as the routing implies (2 × (pairs sent + pairs received) × hidden × 4 B) | — | "
        f"{implied / mib:.2f} MiB | {measured / implied:.3f} counted / implied |",
        f"| pairs whose expert is on another rank | — | {leaving:.1%} | — |",
        f"| step time, median | {dp_t * 1e3:.1f} ms | {ep_t * 1e3:.1f} ms | {paired:.2f} (median of paired steps) |",
    ])
    print(table)
    run.write(_report.results_dir(args), "moe_step.md", "Qwen3.5-MoE: expert parallelism against every expert gathered", table)


if __name__ == "__main__":
    main()
