"""lm_head + loss under tensor parallelism: time and activation memory per rank.

    python benchmarks/vocab_parallel_step.py [--tp 2] [--seq 512] [--vocab 65536] [--steps 6] [--smoke]

- ours: `apply_vocab_parallel_lm_head`: each rank computes the logits of its vocab / tp
  entries and `VocabParallelCausalLMLoss` combines them (three [tokens] all-reduces);
- full-vocab logits on every rank: what a replicated lm_head, or Transformers' plan for
  the lm_head (`colwise_gather_output`: the logits are gathered before the loss), leaves
  each rank with; timed without the gather, a lower bound of that plan's cost.
Both live in the same tp ranks (gloo, 1 thread each) and their steps alternate; forward +
backward of lm_head and loss on [1, seq, hidden] hidden states. Activation memory is the
bytes of tensors saved for backward (deduplicated by storage; parameters not counted). Prints a markdown table
with the medians and the ratios ours / full-vocab, and writes it to
`benchmarks/results/vocab_parallel_step.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import _report
from qwen35_accel.testing.saved_tensors import saved_storage_bytes

HIDDEN = 256


def _worker(rank: int, world: int, seq: int, vocab: int, hidden_size: int, steps: int, path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.loss.loss_utils import ForCausalLMLoss

    from qwen35_accel.parallel.tensor_parallel import apply_vocab_parallel_lm_head
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    shape = dict(hidden_size=hidden_size, vocab_size=vocab, num_hidden_layers=1, layer_types=["linear_attention"])
    ours = build_tiny_causal_lm(seed=0, **shape)
    apply_vocab_parallel_lm_head(ours, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    full = build_tiny_causal_lm(seed=0, **shape)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, seq, hidden_size, generator=generator)
    labels = torch.randint(0, vocab, (1, seq), generator=generator)
    runs = {
        "ours": lambda x: ours.loss_function(ours.lm_head(x), labels, vocab),
        "full_vocab": lambda x: ForCausalLMLoss(full.lm_head(x), labels, vocab),
    }
    memory, losses = {}, {}
    for name, run in runs.items():
        x = hidden.clone().requires_grad_()
        holder: dict = {}
        params = list(ours.parameters()) + list(full.parameters())
        memory[name] = saved_storage_bytes(lambda run=run, x=x: holder.update(loss=run(x)), exclude=params)[1]
        holder["loss"].backward()
        losses[name] = holder["loss"].item()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(steps + 1):
        for name, run in runs.items():
            dist.barrier()
            started = time.perf_counter()
            run(hidden.clone().requires_grad_()).backward()
            dist.barrier()
            if i >= 1:  # warm-up
                times[name].append(time.perf_counter() - started)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"memory": memory, "times": times, "losses": losses}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--steps", type=int, default=6)
    _report.add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.vocab, args.hidden, args.steps = 32, 512, 32, 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from qwen35_accel.testing.local_world import run_local_world

    run = _report.Run()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vocab_parallel_step.json")
        run_local_world(_worker, args.tp, args.seq, args.vocab, args.hidden, args.steps, path, threads_per_rank=1)
        with open(path) as f:
            result = json.load(f)
    t = result["times"]
    ours_t, full_t = (statistics.median(t[k]) for k in ("ours", "full_vocab"))
    paired = statistics.median(a / b for a, b in zip(t["ours"], t["full_vocab"]))
    mem, losses = result["memory"], result["losses"]
    table = "\n".join([
        f"lm_head + loss, tp {args.tp}, seq {args.seq}, hidden {args.hidden}, vocab {args.vocab}, {args.steps} timed steps each "
        f"(alternating); loss ours {losses['ours']:.6f}, full vocab {losses['full_vocab']:.6f} "
        f"(relative difference {abs(losses['ours'] - losses['full_vocab']) / abs(losses['full_vocab']):.1e})\n",
        "| per rank | ours (vocab-parallel) | full-vocab logits (lower bound) | ratio |",
        "|---|---|---|---|",
        f"| step time, median | {ours_t * 1e3:.1f} ms | {full_t * 1e3:.1f} ms | {paired:.2f} (median of paired steps) |",
        f"| activation memory | {mem['ours'] / 2**20:.1f} MiB | {mem['full_vocab'] / 2**20:.1f} MiB | "
        f"{mem['ours'] / mem['full_vocab']:.2f} |",
    ])
    print(table)
    run.write(_report.results_dir(args), "vocab_parallel_step.md", "Vocab-parallel lm_head + loss: time and activation memory per rank", table)


if __name__ == "__main__":
    main()
