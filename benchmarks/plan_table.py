"""What `qwen35-accel plan` predicts: the longest context that fits, per cp, tiled loss (both modes) vs Transformers'.

    python benchmarks/plan_table.py [--gpus 8] [--gpu-memory 141GB] [--smoke]

No model is built and nothing runs on a GPU: every figure comes from
`qwen35_accel.memory` (the memory model behind `plan`, validated against saved-tensor
hooks on CPU by tests/test_memory_model.py; its GPU kernels' figures are from what FLA's and
causal-conv1d's autograd functions save, not measured here). Setting: bf16 mixed precision
(fp32 master weights), AdamW, batch 1, activation checkpointing on, FSDP2 over
dp_shard × cp = the GPU count, no TP, prefetch depths 1 (forward) and 2 (backward).
Shapes: 9B from benchmarks/gpu_step.py (Qwen/Qwen3.5-9B model card); 27B the 27B-like
shape of tests/test_cli.py (hidden 5120, 64 layers, vocab 248320; its head counts are not
checked against a published config.json).
"""

from __future__ import annotations

import argparse
from typing import Any

import _report

# tests/test_cli.py::test_plan_27b_config_on_meta_adds_up_to_the_model
SHAPE_27B: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, tie_word_embeddings=False,
)
STEP = 1024  # context lengths are multiples of this


def _shapes(smoke: bool) -> dict[str, Any]:
    from gpu_step import COMMON, SHAPES, SMOKE_SHAPE
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from qwen35_accel.memory import ModelShape

    common = {k: v for k, v in COMMON.items() if k != "partial_rotary_factor"}  # the config's default is 0.25 too
    chosen = {"smoke": SMOKE_SHAPE} if smoke else {"9B": SHAPES["9B"], "27B": SHAPE_27B}
    return {name: ModelShape.from_config(Qwen3_5TextConfig(**{**common, **shape})) for name, shape in chosen.items()}


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens else "does not fit"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-memory", default="141GB", help="memory per GPU (H200: 141 GB)")
    _report.add_arguments(parser)
    args = parser.parse_args()
    from qwen35_accel.memory import Parallel, StepOptions, estimate, longest_seq_len, parse_bytes

    run = _report.Run()
    budget = parse_bytes(args.gpu_memory)
    cps = [cp for cp in (1, 2, 4, 8) if args.gpus % cp == 0]
    lines = [
        f"Longest context (tokens per sequence, a multiple of {STEP}) whose predicted peak per GPU fits "
        f"{args.gpu_memory} ({budget / 2**30:.1f} GiB) on {args.gpus} GPUs: bf16, AdamW, batch 1, activation "
        "checkpointing, FSDP2 over dp_shard x cp, no TP.\n",
        "| model | loss | " + " | ".join(f"cp {cp}" for cp in cps) + " |",
        "|---|---|" + "---|" * len(cps),
    ]
    details = []
    for name, shape in _shapes(args.smoke).items():
        for tiled, offload, label in (("recompute", False, "tiled, recompute (default)"), ("hold", False, "tiled, hold"),
                                      ("off", False, "Transformers'"), ("recompute", True, "tiled, recompute, activation offload")):
            options = StepOptions(seq_len=STEP, activation_checkpointing=True, tiled_loss=tiled, activation_offload=offload)
            longest = {}
            for cp in cps:
                parallel = Parallel(dp_shard=args.gpus // cp, cp=cp)
                longest[cp] = longest_seq_len(shape, parallel, options, budget, step=STEP)
                if longest[cp]:
                    at = estimate(shape, parallel, StepOptions(**{**options.__dict__, "seq_len": longest[cp]}))
                    parts = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in at.as_dict().items())
                    details.append(f"| {name} | {label} | {cp} | {_k(longest[cp])} | {parts} |")
            lines.append(f"| {name} | {label} | " + " | ".join(_k(longest[cp]) for cp in cps) + " |")
    lines += [
        "\nAt those lengths, per GPU (GiB):\n",
        "| model | loss | cp | context | memory per rank |",
        "|---|---|---|---|---|",
        *details,
    ]
    table = "\n".join(lines)
    print(table)
    run.write(_report.results_dir(args), "plan_table.md", "What `plan` predicts: the longest context on 8 x H200",
              f"{__doc__.split(chr(10), 3)[3].strip()}\n\n{table}\n")


if __name__ == "__main__":
    main()
