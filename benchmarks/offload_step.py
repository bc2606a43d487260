"""Activation offload: per-rank saved bytes and step time with and without it, side by side.

    python benchmarks/offload_step.py [--seqs 4096] [--cp 2] [--rounds 3] [--warmup 1] [--steps 2]
                                      [--device cpu|cuda] [--smoke]

Both variants checkpoint every decoder layer (`PARALLELIZER.apply(activation_checkpointing=True)`);
one adds `activation_offload=True`. On CPU: the tiny-but-wide model of cp_memory.py (hidden 512,
4 layers, fp32, sdpa) in a gloo world of `--cp` ranks (1 thread each), the offload with
`always_copy` so that its copy path (host copies, prefetch, dedupe) runs although nothing has to
move. With `--device cuda`: one process on the GPU (a world of 1, bf16 compute under FSDP2's
policy), a wider model (hidden 2048, 8 layers), and the peak (`torch.cuda.max_memory_allocated`)
above what the model holds before the step; there the copies run on the side stream.
Each world runs `--rounds` rounds of: the model without offload, then with, each built afresh,
one untimed step measuring what the forward saves (`saved_bytes_by_part`: distinct storages,
parameters excluded, the decoder's part: offloaded inputs are not on the device, so they are not
counted there) and the offload's stats (bytes in host memory, prefetched tensors), `--warmup`
untimed and `--steps` timed steps (forward + backward + SGD; barrier before each; a step's time is
its slowest rank's). Reported per sequence: medians, the ratios offload / no offload, the losses.
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
from cp_memory import SMOKE_SHAPE, WIDE_SHAPE, make_batch, shape_note

# --device cuda: the 2B-like layer widths (gpu_step.py's SHAPES["2B"]) at 8 layers, a small vocabulary.
CUDA_SHAPE: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, vocab_size=32768,
)
MIB = 2**20


def _build(cp: int, seq: int, shape: dict[str, Any], offload: bool, device: str):
    """(model, mesh): checkpointed, with or without offload, on `device` (bf16 compute on CUDA)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.model.state import find_state
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    if cp == 1:
        mesh = init_device_mesh(device, (1,), mesh_dim_names=("dp_shard_cp",))
    else:
        mesh = init_device_mesh(device, (1, cp), mesh_dim_names=("dp_shard", "cp"))
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = build_tiny_causal_lm(seed=0, max_position_embeddings=seq, **shape).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device == "cuda" else None
    PARALLELIZER.apply(model, mesh, mp_policy=policy, activation_checkpointing=True, activation_offload=offload)
    if offload:
        find_state(model).activation_offload.always_copy = device == "cpu"  # run the copy path on CPU too
    return model, mesh


def _worker(rank: int, world: int, seq: int, rounds: int, warmup: int, steps: int, device: str, shape: dict[str, Any],
            out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from qwen35_accel.model.state import find_state, state_of
    from qwen35_accel.testing.saved_tensors import saved_bytes_by_part

    cuda = device == "cuda"
    results: dict[str, dict[str, Any]] = {name: {"times": [], "cpu": []} for name in ("off", "on")}
    for _ in range(rounds):
        for name in ("off", "on"):
            model, mesh = _build(world, seq, shape, name == "on", device)
            batch = {k: v.to(device) for k, v in make_batch(world, seq, mesh, shape).items()}
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            offload = (find_state(model) or state_of(model)).activation_offload

            def step() -> float:
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return float(loss.detach())

            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated() if cuda else 0
            loss, saved = saved_bytes_by_part(model, lambda: model(**batch).loss)
            loss.backward()
            optimizer.zero_grad(set_to_none=True)
            stats = offload.stats if offload is not None else None
            record = results[name]
            record.update(saved_decoder=saved["decoder"], host=stats.moved_bytes if stats else 0,
                          prefetched=stats.prefetched_tensors if stats else 0, loss=float(loss.detach()))
            del loss
            for i in range(warmup + steps):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                start, cpu_start = time.perf_counter(), time.process_time()
                step()
                if cuda:
                    torch.cuda.synchronize()
                if i >= warmup:
                    record["times"].append(time.perf_counter() - start)
                    record["cpu"].append(time.process_time() - cpu_start)
            if cuda:
                record["peak_above_model"] = torch.cuda.max_memory_allocated() - resident
            del model, optimizer, batch
    _report.write_gathered({"rank": rank, **results}, world, rank, out_path)


def _table(seq: int, world: int, gathered: list[dict], device: str) -> tuple[list[str], dict[str, float]]:
    """The rows of one sequence's worlds, and its ratios (offload / no offload)."""
    lines = []
    steps = {name: _report.slowest_rank_steps([res[name] for res in gathered]) for name in ("off", "on")}
    for name, label in (("off", "checkpointing"), ("on", "checkpointing + offload")):
        for res in gathered:
            r = res[name]
            peak = f"{r['peak_above_model'] / MIB:.1f}" if "peak_above_model" in r else "-"
            lines.append(f"| {seq} | {label} | {res['rank']} | {r['saved_decoder'] / MIB:.2f} | {r['host'] / MIB:.2f} | "
                         f"{r['prefetched']} | {statistics.median(r['times']):.3f} | {peak} | {r['loss']:.6f} |")
        lines.append(f"| {seq} | {label} | slowest rank per step | | | | **{statistics.median(steps[name]):.3f}** | | |")
    saved = {name: max(res[name]["saved_decoder"] for res in gathered) for name in ("off", "on")}
    # CPU time per rank (busiest rank per step): less sensitive to other load than the wall time.
    cpu = {name: statistics.median(max(cs) for cs in zip(*(res[name]["cpu"] for res in gathered))) for name in ("off", "on")}
    ratios = {"saved": saved["on"] / saved["off"],
              "step": statistics.median(steps["on"]) / statistics.median(steps["off"]), "cpu": cpu["on"] / cpu["off"]}
    if device == "cuda":
        ratios["peak"] = gathered[0]["on"]["peak_above_model"] / gathered[0]["off"]["peak_above_model"]
    return lines, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="tokens per row (default: 4096 on CPU, 32768 65536 on CUDA)")
    parser.add_argument("--cp", type=int, default=None, help="ranks (default: 2 on CPU, 1 on CUDA: one process on the GPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per world before it is killed")
    _report.add_arguments(parser)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    shape = CUDA_SHAPE if cuda else WIDE_SHAPE
    seqs = args.seqs or ([32768, 65536] if cuda else [4096])
    cp = args.cp or (1 if cuda else 2)
    if args.smoke:
        seqs, args.rounds, args.warmup, args.steps, shape = [128], 1, 0, 1, SMOKE_SHAPE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from qwen35_accel.testing.local_world import run_local_world

    run = _report.Run()
    rows, summary = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in seqs:
            path = os.path.join(tmp, f"seq{seq}.json")
            run_local_world(_worker, cp, seq, args.rounds, args.warmup, args.steps, args.device, shape, path,
                            threads_per_rank=1, timeout=args.timeout)
            lines, ratios = _table(seq, cp, json.loads(Path(path).read_text()), args.device)
            rows += lines
            summary.append(
                f"seq {seq}: **Saved bytes on the device per rank (decoder), offload / no offload: {ratios['saved']:.3f}**; "
                f"**Step time, offload / no offload (medians, slowest rank): {ratios['step']:.3f}** (CPU time per rank, "
                f"busiest rank: {ratios['cpu']:.3f})"
                + (f"; **Peak above the model, offload / no offload: {ratios['peak']:.3f}**" if "peak" in ratios else ""))
    note = shape_note(shape).replace(", fp32, sdpa", "")
    if shape["num_hidden_layers"] != 4:  # shape_note names the 4-layer pattern; the tiny model's is every third full
        note = note.replace("(linear, linear, full, linear attention)", "(every third one full attention)")
    where = ("one process on the GPU, bf16 compute (FSDP2 policy), the copies on a side stream" if cuda else
             f"cp {cp} (world {cp}, gloo, 1 thread per rank), fp32, offload with always_copy (the copy path runs on CPU)")
    lines = [
        f"Both variants checkpoint every decoder layer; {where}; batch 1, {args.rounds} rounds x (without, with offload), "
        f"1 probe + {args.warmup} warmup + {args.steps} timed steps (forward + backward + SGD) each; "
        f"{note}.\n",
        "| seq | variant | rank | saved on the device: decoder (MiB) | in host memory (MiB) | prefetched tensors | "
        "median step (s) | peak above the model (MiB) | loss |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *summary,
        "",
        "Saved on the device: what the forward keeps for backward in the decoder (distinct storages, parameters "
        "excluded); with offload the layers' inputs are in host memory instead (the next column), and what stays is "
        "what the embedding and the rotary embedding save. "
        + ("On CPU the copies are memory copies in the ranks' own thread, in series with the compute: the step time "
           "ratio is their cost and the bookkeeping's, not a GPU's (there they run on a side stream, over PCIe)."
           if not cuda else ""),
    ]
    table = "\n".join(lines)
    print(table)
    run.write(_report.results_dir(args), "offload_step.md" if not cuda else "offload_step_cuda.md",
              "Activation offload: saved bytes and step time per rank", table)


if __name__ == "__main__":
    main()
