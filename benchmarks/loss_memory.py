"""The loss path at Qwen3.5's vocabulary: memory and time, the tiled loss's two modes vs Transformers' loss.

    python benchmarks/loss_memory.py [--vocab 248320] [--hidden 512 1024] [--tokens 2048] [--cp 1 2] [--steps 3]
                                     [--device cpu|cuda] [--dtype fp32|bf16] [--tile-bytes N] [--smoke]

The loss path is the lm_head and the cross entropy on given hidden states `[tokens, hidden]`
(what the decoder hands over): forward + backward, in `--dtype` (fp32 by default; bf16 as
under a bf16 policy: bf16 logits, Transformers' loss then upcasts them), every token labelled.
- recompute, hold: `parallel.tiled_head.linear_cross_entropy_sum` in that mode (blocks of
  `tiled_blocks.block_shape(tokens, vocab)` tokens × vocab rows; recompute: one log-sum-exp
  per token kept, each block recomputed in backward; hold: gradients computed in forward and
  held) and the loss reduction `PARALLELIZER.apply` installs;
- Transformers: `lm_head(hidden)` then Transformers' `ForCausalLMLoss` (our `CausalLMLoss`
  over the cp group under cp 2, as the parallelizer installs it).
Under cp 2 each of 2 gloo ranks holds half the tokens (figures per rank, rank 0).
Per configuration: bytes saved for backward (saved-tensor hooks, distinct storages, the
weight excluded) and the peak memory of one step above the set-up (each variant in fresh
processes; on CPU every tensor's storage from allocation to release, torch's `MemTracker`;
on `--device cuda` `torch.cuda.max_memory_allocated`), with the inputs' gradients (alive at
every variant's end) and the peak beyond them shown apart; then the step time, the three variants
alternating in one world (median of paired ratios; CUDA synchronised). `--device cuda` runs
cp 1 only (one GPU). Writes `benchmarks/results/loss_memory.md` (fp32 on CPU) or
`loss_memory_<device>_<dtype>.md`; `--tile-bytes N` (another block size) adds `_tile<MiB>MiB`.
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

TILED = ("recompute", "hold")  # the tiled loss's modes (`tiled_head.LOSS_MODES`)
VARIANTS = (*TILED, "transformers")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _setup(rank: int, world: int, tokens: int, hidden: int, vocab: int, device: str = "cpu", dtype: str = "fp32"):
    generator = torch.Generator().manual_seed(rank)
    local = tokens // world
    x = torch.randn(local, hidden, generator=generator).to(device, DTYPES[dtype])
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) / hidden**0.5
    weight = torch.nn.Parameter(weight.to(device, DTYPES[dtype]))
    labels = torch.randint(0, vocab, (local,), generator=generator).to(device)
    return x, weight, labels


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _loss(variant: str, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, world: int,
          tile_bytes: int | None = None) -> torch.Tensor:
    import torch.distributed as dist
    import torch.nn.functional as F

    from qwen35_accel.parallel.losses import CausalLMLoss, reduce_token_loss
    from qwen35_accel.parallel.tiled_blocks import TILE_BYTES, block_shape
    from qwen35_accel.parallel.tiled_head import linear_cross_entropy_sum

    group = dist.group.WORLD if world > 1 else None
    if variant in TILED:
        tile, vocab_tile = block_shape(x.shape[0], weight.shape[0], tile_bytes or TILE_BYTES)
        local_sum = linear_cross_entropy_sum(x, weight, None, labels, mode=variant, tile=tile, vocab_tile=vocab_tile)
        return reduce_token_loss(local_sum, torch.tensor(labels.numel()), None, group)
    logits = F.linear(x, weight)[None]
    if group is not None:
        return CausalLMLoss(cp_group=group)(logits, None, weight.shape[0], shift_labels=labels[None])
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, None, weight.shape[0], shift_labels=labels[None])


def _memory_worker(rank: int, world: int, variant: str, tokens: int, hidden: int, vocab: int, path: str,
                   device: str = "cpu", dtype: str = "fp32", tile_bytes: int | None = None) -> None:
    from qwen35_accel.testing.saved_tensors import peak_bytes_above, saved_storage_bytes

    x, weight, labels = _setup(rank, world, tokens, hidden, vocab, device, dtype)
    x.requires_grad_()

    def step() -> tuple[torch.Tensor, int]:
        loss, saved = saved_storage_bytes(lambda: _loss(variant, x, weight, labels, world, tile_bytes), exclude=[weight])
        loss.backward()
        _sync(device)
        return loss, saved

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss, saved = step()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        (loss, saved), peak = peak_bytes_above(step, [x, weight])
    grads = sum(t.grad.untyped_storage().nbytes() for t in (x, weight))
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"saved": saved, "peak": peak, "grads": grads, "loss": loss.item()}, f)


def _time_worker(rank: int, world: int, tokens: int, hidden: int, vocab: int, steps: int, path: str,
                 device: str = "cpu", dtype: str = "fp32", tile_bytes: int | None = None) -> None:
    import torch.distributed as dist

    x, weight, labels = _setup(rank, world, tokens, hidden, vocab, device, dtype)
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for step in range(steps + 1):
        for variant in VARIANTS[step % 3 :] + VARIANTS[: step % 3]:  # each variant first in turn
            if world > 1:
                dist.barrier()
            _sync(device)
            started = time.perf_counter()
            _loss(variant, x.clone().requires_grad_(), weight, labels, world, tile_bytes).backward()
            _sync(device)
            weight.grad = None
            if step:  # the first is a warm-up
                times[variant].append(time.perf_counter() - started)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(times, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--tile-bytes", type=int, default=None,
                        help="fp32 bytes of one block's logits (default: the library's, tiled_blocks.TILE_BYTES)")
    _report.add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.vocab, args.hidden, args.tokens, args.cp, args.steps = 4096, [64], [256], [1, 2], 1
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("loss_memory.py --device cuda: no CUDA device here")
        args.cp = [1]  # one GPU
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from qwen35_accel.parallel.tiled_blocks import TILE_BYTES, block_shape
    from qwen35_accel.testing.local_world import run_local_world

    threads = max(1, (os.cpu_count() or 1) // max(args.cp))
    tile_bytes = args.tile_bytes or TILE_BYTES
    run = _report.Run()
    rows, steps_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden in args.hidden:
            for tokens in args.tokens:
                for cp in args.cp:
                    found = {}
                    for variant in VARIANTS:
                        path = os.path.join(tmp, f"{variant}.json")
                        run_local_world(_memory_worker, cp, variant, tokens, hidden, args.vocab, path, args.device, args.dtype,
                                        tile_bytes, threads_per_rank=threads)
                        with open(path) as f:
                            found[variant] = json.load(f)
                    path = os.path.join(tmp, "times.json")
                    run_local_world(_time_worker, cp, tokens, hidden, args.vocab, args.steps, path, args.device, args.dtype,
                                    tile_bytes, threads_per_rank=threads)
                    with open(path) as f:
                        times = json.load(f)
                    blocks = "×".join(map(str, block_shape(tokens // cp, args.vocab, tile_bytes)))
                    r = found["transformers"]
                    r_beyond = r["peak"] - r["grads"]
                    for v in ("transformers", *TILED):
                        f, beyond = found[v], found[v]["peak"] - found[v]["grads"]
                        ratio = "" if v == "transformers" else (
                            f"{statistics.median(a / b for a, b in zip(times[v], times['transformers'])):.2f}")
                        cells = [
                            v, f"{f['saved'] / 2**20:.1f}", "" if v == "transformers" else f"{r['saved'] / f['saved']:.0f}×",
                            f"{f['peak'] / 2**20:.0f}", f"{f['grads'] / 2**20:.0f}", f"{beyond / 2**20:.1f}",
                            "" if v == "transformers" else f"{r_beyond / beyond:.0f}×",
                            f"{statistics.median(times[v]) * 1e3:.0f}", ratio,
                            "" if v == "transformers" else f"{abs(f['loss'] - r['loss']) / abs(r['loss']):.1e}",
                        ]
                        rows.append(f"| {hidden} | {tokens} | {cp} | {blocks} | " + " | ".join(cells) + " |")
                        print(rows[-1], flush=True)
                    steps_rows.append(f"| {hidden}, {tokens}, cp {cp} | " + " | ".join(
                        ", ".join(f"{t * 1e3:.0f}" for t in times[v]) for v in ("transformers", *TILED)) + " |")
    peak_kind = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "every tensor's bytes, MemTracker"
    table = "\n".join([
        f"Loss path (lm_head + cross entropy, forward + backward, {args.dtype}, {args.device}) at vocab {args.vocab}; blocks of "
        f"tokens × vocab rows (at most {tile_bytes / 2**20:.0f} MiB of fp32 logits); per rank (rank 0); {args.steps} timed steps per variant, alternating; "
        f"{threads} threads per rank. Saved for backward: saved-tensor hooks, the weight excluded. Peak: above the "
        f"set-up ({peak_kind}); the inputs' gradients (hidden states and weight) are what every variant hands back and "
        "are alive at its end; beyond them: the loss path's own working memory. × less: Transformers' figure over the "
        "variant's.\n",
        "| hidden | tokens | cp | block | variant | saved for backward (MiB) | × less saved | peak (MiB) | of it, the inputs' "
        "gradients (MiB) | peak beyond the gradients (MiB) | × less beyond | step (ms, median) | time vs Transformers "
        "(median of pairs) | loss relative difference |",
        "|" + "---|" * 14,
        *rows,
        "\nEvery timed step (ms), in order; in step s the variants ran in the order recompute, hold, "
        "Transformers rotated by s (each first in turn):\n",
        "| hidden, tokens, cp | Transformers | recompute | hold |",
        "|---|---|---|---|",
        *steps_rows,
    ])
    print(table)
    name = "loss_memory" + ("" if (args.device, args.dtype) == ("cpu", "fp32") else f"_{args.device}_{args.dtype}")
    name += ("" if args.tile_bytes is None else f"_tile{args.tile_bytes // 2**20}MiB") + ".md"
    run.write(_report.results_dir(args), name, "The loss path at Qwen3.5's vocabulary: tiled (recompute, hold) vs Transformers", table)


if __name__ == "__main__":
    main()
