"""Activation memory per rank under context parallelism: cp 2 (world 2) vs cp 1 (world 1).

    python benchmarks/cp_memory.py [--seq 16384] [--cp 2] [--backward] [--smoke]

A tiny-but-wide dense Qwen3.5 (hidden 512, 4 layers: 3 GatedDeltaNet + 1 full attention,
fp32, sdpa) under `PARALLELIZER.apply`, one forward (+ backward with `--backward`):
- cp 1: world 1, mesh ("dp_shard_cp",), the whole batch (labels = input_ids);
- cp 2: world 2, Accelerate's mesh ("dp_shard", "cp") = (1, 2) + flattened "dp_shard_cp",
  `shard_batch(batch, mesh["cp"])` (CP and FSDP2 installed).
Activation memory = total bytes of the tensors saved for backward during the forward
(`torch.autograd.graph.saved_tensors_hooks`; deduplicated by untyped storage data_ptr,
counting each storage's nbytes; storages of parameters excluded, they are weights).
Default sequence 16k: the longest power of 2 that fits comfortably with two processes in
this machine's 24 GiB (32k fits too, with ~19 GiB in use at the peak of the cp 2 world).
Secondary: peak RSS per rank (`ru_maxrss`) before and after the step. By default the step
is the forward only (the backward of Transformers' CPU reference GatedDeltaNet kernel is
too slow at these lengths for a 3-minute run); `--backward` adds it.
Target: activation memory per rank at cp 2 <= 0.6 x cp 1.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
from pathlib import Path
from typing import Any

import torch

import _report

TARGET = 0.6

# A tiny-but-wide dense Qwen3.5: 4 layers = linear, linear, full, linear attention (shared with cp_step.py).
WIDE_SHAPE: dict[str, Any] = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, vocab_size=512,
)
# --smoke (here and in cp_step.py): the same layer pattern, small.
SMOKE_SHAPE: dict[str, Any] = dict(
    WIDE_SHAPE, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=128,
)


def shape_note(s: dict[str, Any] = WIDE_SHAPE) -> str:
    return (
        f"model: hidden {s['hidden_size']}, intermediate {s['intermediate_size']}, {s['num_hidden_layers']} layers "
        f"(linear, linear, full, linear attention), attention heads {s['num_attention_heads']} (kv {s['num_key_value_heads']}) "
        f"x {s['head_dim']}, GatedDeltaNet key/value heads {s['linear_num_key_heads']}/{s['linear_num_value_heads']} x "
        f"{s['linear_key_head_dim']}, conv kernel {s['linear_conv_kernel_dim']}, vocab {s['vocab_size']}, batch 1, fp32, sdpa"
    )


def build_parallel_model(cp: int, seq: int, shape: dict[str, Any] = WIDE_SHAPE):
    """(model under PARALLELIZER.apply, mesh): world 1 without CP for cp=1, else Accelerate's mesh shape."""
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    if cp == 1:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard_cp",))
    else:
        mesh = init_device_mesh("cpu", (1, cp), mesh_dim_names=("dp_shard", "cp"))
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = build_tiny_causal_lm(seed=0, max_position_embeddings=seq, **shape)
    PARALLELIZER.apply(model, mesh)
    return model, mesh


def make_batch(cp: int, seq: int, mesh, shape: dict[str, Any] = WIDE_SHAPE) -> dict[str, torch.Tensor]:
    """The same whole batch on every rank (labels = input_ids); this rank's part under CP."""
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import random_batch

    batch = random_batch(1, seq, shape["vocab_size"], seed=0)
    return batch if cp == 1 else shard_batch(batch, mesh["cp"])


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _param_storages(model: torch.nn.Module) -> set[int]:
    """data_ptrs of the storages of the parameters registered now (sharded DTensors: their local shard)."""
    from torch.distributed.tensor import DTensor

    ptrs = set()
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        ptrs.add(local.untyped_storage().data_ptr())
    return ptrs


def _worker(rank: int, world: int, cp: int, seq: int, backward: bool, shape: dict[str, Any], out_path: str) -> None:
    model, mesh = build_parallel_model(cp, seq, shape)
    batch = make_batch(cp, seq, mesh, shape)
    rss_before = _rss_mib()

    saved: dict[int, int] = {}  # storage data_ptr -> nbytes
    shapes: dict[int, str] = {}
    owner: dict[int, str] = {}  # storage data_ptr -> component that saved it first
    current = ["other"]

    # Attribute each saved storage to the component running when it was saved.
    for layer in model.model.layers:
        for attr, component in (("linear_attn", "GatedDeltaNet"), ("self_attn", "full attention"), ("mlp", "MLP")):
            module = getattr(layer, attr, None)
            if module is not None:
                module.register_forward_pre_hook(lambda m, a, c=component: current.__setitem__(0, c))
                module.register_forward_hook(lambda m, a, o: current.__setitem__(0, "other"))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        # Parameters as registered right now (FSDP2 swaps in the unsharded ones during a unit's forward).
        if not nbytes or ptr in _param_storages(model):
            return t
        if nbytes >= saved.get(ptr, 0):
            saved[ptr] = nbytes
            shapes[ptr] = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            owner.setdefault(ptr, current[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    activation = sum(saved.values())
    rss_forward = _rss_mib()
    if backward:
        loss.backward()
    rss_after = _rss_mib()
    top = sorted(saved, key=saved.get, reverse=True)[:6]
    by_component: dict[str, int] = {}
    for ptr, nbytes in saved.items():
        by_component[owner[ptr]] = by_component.get(owner[ptr], 0) + nbytes
    result = {
        "rank": rank,
        "activation_bytes": activation,
        "by_component": by_component,
        "storages": len(saved),
        "top": [(saved[p], shapes[p], owner[p]) for p in top],
        "rss_before_mib": rss_before,
        "rss_forward_mib": rss_forward,
        "rss_peak_mib": rss_after,
        "loss": float(loss.detach()),
        "local_tokens": int(batch["input_ids"].shape[1]),
    }
    _report.write_gathered(result, world, rank, out_path)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384,
                        help="16k: the longest power of 2 that fits comfortably in 24 GiB (32k fits, ~19 GiB in use at peak)")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--backward", action="store_true",
                        help="also run the backward (peak RSS of the whole step); slow on CPU at long sequences")
    parser.add_argument("--out-name", default="cp_memory", help="results file stem (in --results-dir)")
    _report.add_arguments(parser)
    args = parser.parse_args()
    shape = WIDE_SHAPE
    if args.smoke:
        args.seq, shape = 128, SMOKE_SHAPE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from qwen35_accel.testing.local_world import run_local_world

    run = _report.Run()
    runs: dict[int, list[dict]] = {}
    threads = {cp: max(1, (os.cpu_count() or 1) // cp) for cp in (1, args.cp)}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (1, args.cp):
            path = os.path.join(tmp, f"cp{cp}.json")
            # Memory does not depend on timing: each world may use every core.
            run_local_world(_worker, cp, cp, args.seq, args.backward, shape, path, threads_per_rank=threads[cp])
            runs[cp] = json.loads(Path(path).read_text())

    base = runs[1][0]["activation_bytes"]
    worst = max(r["activation_bytes"] for r in runs[args.cp])
    ratio = worst / base
    step = "forward + backward" if args.backward else "forward only (activation memory is fixed by the forward)"
    after = "after backward" if args.backward else "end of step"
    lines = [
        f"seq {args.seq} tokens, batch 1, {step}; {shape_note(shape)}.\n",
        "| config | rank | local tokens | activation memory (MiB, saved for backward) | saved storages | peak RSS before step (MiB) | peak RSS after forward (MiB) | loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cp, results in runs.items():
        for r in results:
            lines.append(
                f"| cp {cp} (world {cp}) | {r['rank']} | {r['local_tokens']} | {_mib(r['activation_bytes'])} | {r['storages']} | "
                f"{r['rss_before_mib']:.0f} | {r['rss_forward_mib']:.0f} | {r['loss']:.6f} |"
            )
    verdict = "meets" if ratio <= TARGET else "MISSES"
    lines.append(
        f"\n**Activation memory per rank, cp {args.cp} / cp 1 (worst rank): {ratio:.3f}** "
        f"(target <= {TARGET}: {verdict}; ideal 1/{args.cp} = {1 / args.cp:.3f})."
    )
    growth = {cp: max(r["rss_peak_mib"] - r["rss_before_mib"] for r in results) for cp, results in runs.items()}
    peak = {cp: max(r["rss_peak_mib"] for r in results) for cp, results in runs.items()}
    lines.append(
        f"\nPeak RSS per rank ({after}), worst rank: cp 1 {peak[1]:.0f} MiB, cp {args.cp} {peak[args.cp]:.0f} MiB "
        f"(ratio {peak[args.cp] / peak[1]:.3f}); growth over the step: cp 1 {growth[1]:.0f} MiB, cp {args.cp} "
        f"{growth[args.cp]:.0f} MiB (ratio {growth[args.cp] / growth[1]:.3f}). ru_maxrss is the process's high-water "
        "mark: imports, weights, temporaries and allocator caching included."
    )
    components = sorted({c for results in runs.values() for r in results for c in r["by_component"]})
    lines.append(f"\nBy component (saved for backward, MiB; cp {args.cp}: worst rank):\n")
    lines.append(f"| component | cp 1 | cp {args.cp} | ratio |")
    lines.append("|---|---|---|---|")
    for c in components:
        one = runs[1][0]["by_component"].get(c, 0)
        many = max(r["by_component"].get(c, 0) for r in runs[args.cp])
        lines.append(f"| {c} | {_mib(one)} | {_mib(many)} | {many / one:.3f} |" if one else f"| {c} | 0 | {_mib(many)} | - |")
    for cp, results in runs.items():
        top = "; ".join(f"{_mib(n)} MiB {s} [{o}]" for n, s, o in results[0]["top"])
        lines.append(f"\nLargest saved storages, cp {cp} rank 0: {top}")
    table = "\n".join(lines)
    print(table)

    folder = _report.results_dir(args)
    if folder is not None:
        plt = _report.pyplot()
        run.write(folder, f"{args.out_name}.md", f"Activation memory per rank: cp {args.cp} vs cp 1",
                  f"Threads per rank: cp 1 {threads[1]}, cp {args.cp} {threads[args.cp]} (memory only, no timing).\n\n"
                  f"{table}\n" + (f"\n![activation memory]({args.out_name}.png)\n" if plt else ""))
        if plt:
            _plot(plt, runs, args, ratio, folder)


def _plot(plt, runs, args, ratio, folder: Path) -> None:
    labels, values, colors = [], [], []
    for cp, results in runs.items():
        for r in results:
            labels.append(f"cp {cp}\nrank {r['rank']}")
            values.append(r["activation_bytes"] / 2**20)
            colors.append("tab:gray" if cp == 1 else "tab:blue")
    fig, ax = plt.subplots(figsize=(6, 4.5))
    bars = ax.bar(labels, values, color=colors)
    ax.bar_label(bars, fmt="%.0f")
    base = runs[1][0]["activation_bytes"] / 2**20
    ax.axhline(TARGET * base, color="tab:red", linestyle="--", label=f"target: {TARGET} x cp 1")
    ax.axhline(base / args.cp, color="tab:green", linestyle=":", label=f"ideal: cp 1 / {args.cp}")
    ax.set_ylabel("activation memory per rank (MiB, saved for backward)")
    ax.set_title(f"seq {args.seq}, 4-layer Qwen3.5, fp32: cp {args.cp} / cp 1 = {ratio:.2f}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / f"{args.out_name}.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
