"""Packed rows vs padded batches: real tokens per second and activation memory, same documents.

    python benchmarks/packing_step.py [--max-len 2048] [--docs-per-step 8] [--steps 6] [--smoke]

One process, fp32, the same tiny-but-wide dense Qwen3.5 as cp_memory.py (hidden 512, 3
GatedDeltaNet + 1 full attention, sdpa) with `install_fp32_gate` (the layers qwen35_accel
installs). Document lengths are drawn from a log-normal distribution with median
max-len / 8, clipped to [8, max-len]. Each step takes the next `--docs-per-step`
documents, then runs forward + backward twice, in an order that alternates every step:
- padded: one row per document, right-padded to the longest of the step (what
  `DataCollatorForSeq2Seq` makes), `attention_mask` marking padding;
- packed: one row holding all of them, `position_ids` restarting per document (what
  `DataCollatorWithFlattening` makes).
Reported: median real tokens per second of each and their ratio (target >= 2), median
activation memory (bytes of the tensors saved for backward) and its ratio, and the
per-document parity of one step (max |packed - document alone| over the logits); a plot
of both per step (`packing_step.png`, the latest run's; drawn after the results are written,
and only with matplotlib: `pip install -e ".[benchmarks]"`). Runs are appended to `packing_step.md`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import _report
from qwen35_accel.testing.saved_tensors import saved_storage_bytes
from cp_memory import SMOKE_SHAPE, WIDE_SHAPE, shape_note


def lengths(count: int, max_len: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    median = max_len / 8
    drawn = torch.exp(torch.randn(count, generator=gen) * 1.0 + torch.log(torch.tensor(median)))
    return [int(x) for x in drawn.clamp(8, max_len).round()]


def build_model(shape: dict) -> torch.nn.Module:
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(seed=0, use_cache=True, **shape)
    install_fp32_gate(model)
    return model


def padded_batch(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    longest = max(d.shape[1] for d in docs)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, d in enumerate(docs):
        ids[row, : d.shape[1]] = d[0]
        mask[row, : d.shape[1]] = 1
        labels[row, 1 : d.shape[1]] = d[0, 1:]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.cat(docs, dim=1)
    labels = torch.cat([torch.cat([torch.tensor([[-100]]), d[:, 1:]], dim=1) for d in docs], dim=1)
    positions = torch.cat([torch.arange(d.shape[1])[None] for d in docs], dim=1)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, int]:
    """(seconds of forward + backward, bytes saved for backward)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss, saved = saved_storage_bytes(lambda: model(**batch).loss, exclude=model.parameters())
    loss.backward()
    return time.perf_counter() - start, saved


@torch.no_grad()
def parity(model: torch.nn.Module, docs: list[torch.Tensor]) -> float:
    packed = model(**{k: v for k, v in packed_batch(docs).items() if k != "labels"}).logits
    alone = torch.cat([model(input_ids=d).logits for d in docs], dim=1)
    return float((packed - alone).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--docs-per-step", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    _report.add_arguments(parser)
    args = parser.parse_args()
    shape = SMOKE_SHAPE if args.smoke else WIDE_SHAPE
    if args.smoke:
        args.max_len, args.docs_per_step, args.steps, args.warmup = 128, 4, 2, 0
    run = _report.Run()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(shape)
    vocab = model.config.vocab_size
    total = (args.steps + args.warmup) * args.docs_per_step
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, vocab, (1, n), generator=gen) for n in lengths(total, args.max_len, seed=2)]

    rows: dict[str, list[tuple[float, int, int]]] = {"padded": [], "packed": []}
    for i in range(args.warmup + args.steps):
        group = docs[i * args.docs_per_step : (i + 1) * args.docs_per_step]
        real = sum(d.shape[1] for d in group)
        order = ("padded", "packed") if i % 2 == 0 else ("packed", "padded")
        for kind in order:
            batch = padded_batch(group) if kind == "padded" else packed_batch(group)
            seconds, saved = step(model, batch)
            if i >= args.warmup:
                rows[kind].append((real / seconds, saved, batch["input_ids"].numel()))
        print(f"step {i}: {real} real tokens, padded to {len(group) * max(d.shape[1] for d in group)}", flush=True)

    tps = {k: statistics.median(r[0] for r in v) for k, v in rows.items()}
    mem = {k: statistics.median(r[1] for r in v) for k, v in rows.items()}
    worst = parity(model, docs[: args.docs_per_step])
    real_total = sum(d.shape[1] for d in docs[args.warmup * args.docs_per_step :])
    padded_total = sum(r[2] for r in rows["padded"])
    table = "\n".join([
        f"{shape_note(shape).replace('batch 1, ', '')}; {args.docs_per_step} documents per step, lengths log-normal with median "
        f"{args.max_len // 8}, clipped to [8, {args.max_len}]; {args.steps} timed steps (padded tokens / real: "
        f"{padded_total / real_total:.2f}).",
        "",
        "| layout | real tokens/s (median) | activation MiB (median) |",
        "|---|---|---|",
        *[f"| {k} | {tps[k]:.0f} | {mem[k] / 2**20:.1f} |" for k in ("padded", "packed")],
        "",
        f"packed / padded: real tokens/s {tps['packed'] / tps['padded']:.2f}x (target >= 2), activation memory "
        f"{mem['packed'] / mem['padded']:.2f}x; per-document parity of one step: max |packed - alone| = {worst:.2e}",
    ])
    print(table)
    folder = _report.results_dir(args)
    plt = _report.pyplot() if folder is not None else None
    if plt:
        table += "\n\n![real tokens/s and activation memory per step](packing_step.png)"
    run.write(folder, "packing_step.md", "Packed rows vs padded batches", table, append=True)
    if plt:
        _plot(plt, rows, folder)


def _plot(plt, rows: dict[str, list[tuple[float, int, int]]], folder) -> None:
    """Per timed step: real tokens/s and activation memory of both layouts, side by side."""
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    steps = range(1, len(rows["padded"]) + 1)
    for kind, color in (("padded", "tab:red"), ("packed", "tab:blue")):
        speed.plot(steps, [r[0] for r in rows[kind]], "o-", color=color, label=kind)
        memory.plot(steps, [r[1] / 2**20 for r in rows[kind]], "o-", color=color, label=kind)
    speed.set(xlabel="timed step (same documents for both layouts)", ylabel="real tokens / s", ylim=(0, None))
    memory.set(xlabel="timed step", ylabel="activation MiB (saved for backward)", ylim=(0, None))
    for ax in (speed, memory):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Packed rows vs padded batches (one process, fp32)", fontsize=10)
    fig.tight_layout()
    fig.savefig(folder / "packing_step.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
