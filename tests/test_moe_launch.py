"""Qwen3.5-MoE through the Trainer: `accelerate launch --config_file accelerate_configs/cpu_fsdp2.yaml
recipes/sft.py`, unchanged, against one process without a launcher (issue 46, slice 2).

Before: Accelerate's own FSDP2 path ran (no fp32 gate units; with a bf16 load the gates trained
bf16-rounded) and, before Accelerate 1.16, stopped at its wrap policy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launched import register
from test_trainer_launch import FIXED_LENGTH, PREPARED, SGD, assert_same_training, recipe_run, runs

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOKENIZER = str(Path(__file__).parent.parent / "recipes" / "configs" / "tokenizer")


def save_tiny_moe(path: Path) -> None:
    """`build_tiny_moe_causal_lm` (routers that discriminate, weak decay) at the recipe's
    byte-level vocabulary."""
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

    build_tiny_moe_causal_lm(seed=0, vocab_size=264, eos_token_id=256, pad_token_id=256).save_pretrained(path)


MOE = ("--model_name_or_path", "{in}", "--tokenizer_name_or_path", TOKENIZER, *FIXED_LENGTH, *SGD)
register(**{
    "moe/reference": recipe_run(None, "--per_device_train_batch_size", "4", *MOE, setup=save_tiny_moe),
    "moe/fsdp2": recipe_run("cpu_fsdp2.yaml", "--per_device_train_batch_size", "2", *MOE, setup=save_tiny_moe),
    "moe/cp2": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *MOE, setup=save_tiny_moe),
})


@runs("moe/reference", "moe/fsdp2")
def test_a_qwen35_moe_model_under_fsdp2_gets_fp32_gate_units_and_trains_as_one_process(launched):
    run, reference = launched("moe/fsdp2"), launched("moe/reference")
    lines = [line for line in run.stderr.splitlines() if PREPARED in line]
    assert len(lines) == 1 and "] Qwen3_5MoeForCausalLM prepared by qwen35_accel: dtype-uniform FSDP2 units" in lines[0], run.stderr
    assert "fp32 gate holders" in lines[0] and "loss: tiled, recompute" in lines[0]
    # fp32 rtol 1e-5: FSDP2 sums the two ranks' gradients in another order than one process;
    # every logged value, the saved weights and the fp32 gates (assert_same_training).
    assert_same_training(run.out, reference.out, rtol=1e-5)
    from safetensors.torch import load_file

    saved = load_file(run.out / "model.safetensors")
    # Every expert saved whole (gathered from the shards), in the checkpoint's per-expert names.
    assert {key.split(".")[5] for key in saved if key.startswith("model.layers.0.mlp.experts.")} == set("012345")
    assert saved["model.layers.0.linear_attn.dt_bias"].dtype == torch.float32


@runs("moe/reference", "moe/cp2")
def test_a_qwen35_moe_model_under_cp2_trains_as_one_process(launched):
    """cpu_fsdp2_cp2.yaml: both ranks hold the same 4 rows, each its chunks of every row (before:
    Accelerate refused CP for the model)."""
    run, reference = launched("moe/cp2"), launched("moe/reference")
    lines = [line for line in run.stderr.splitlines() if PREPARED in line]
    assert len(lines) == 1 and "Qwen3_5MoeForCausalLM prepared by qwen35_accel" in lines[0] and "cp=2" in lines[0], run.stderr
    assert_same_training(run.out, reference.out, rtol=1e-5)
