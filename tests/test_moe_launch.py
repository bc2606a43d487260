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
from test_trainer_launch import FIXED_LENGTH, PREPARED, RESUME_FROM, SGD, assert_same_training, losses, recipe_run, runs

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOKENIZER = str(Path(__file__).parent.parent / "recipes" / "configs" / "tokenizer")


def save_tiny_moe(path: Path) -> None:
    """`build_tiny_moe_causal_lm` (routers that discriminate, weak decay) at the recipe's
    byte-level vocabulary."""
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

    build_tiny_moe_causal_lm(seed=0, vocab_size=264, eos_token_id=256, pad_token_id=256).save_pretrained(path)


def save_tiny_moe8(path: Path) -> None:
    """`save_tiny_moe` with 8 experts: ep 2 x tp 2 holds 2 per rank."""
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

    build_tiny_moe_causal_lm(seed=0, vocab_size=264, eos_token_id=256, pad_token_id=256, num_experts=8).save_pretrained(path)


EP2 = {"QWEN35_ACCEL_EP": "2"}
# SGD with momentum: linear in the gradients, as plain SGD (see test_trainer_launch), and with an
# optimizer state for the checkpoints to carry (torch's full-state-dict load of a stateless
# optimizer raises "Expected device to be set").
MOE = ("--model_name_or_path", "{in}", "--tokenizer_name_or_path", TOKENIZER, *FIXED_LENGTH, *SGD, "--optim_args", "momentum=0.9")
register(**{
    "moe/reference": recipe_run(None, "--per_device_train_batch_size", "4", *MOE, setup=save_tiny_moe),
    "moe/fsdp2": recipe_run("cpu_fsdp2.yaml", "--per_device_train_batch_size", "2", *MOE, setup=save_tiny_moe),
    "moe/cp2": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *MOE, *RESUME_FROM,
                          setup=save_tiny_moe),
    # Expert parallelism from the knob, the YAML unchanged: ep 2 over cp 2's two ranks (ep x cp at world 2).
    "moe/ep2-cp2": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *MOE, *RESUME_FROM,
                              setup=save_tiny_moe, env=EP2),
    # dp 2 x tp 2 (world 4): head-parallel mixers, the shared expert split as an MLP, the routed experts whole over tp.
    "moe/dp2xtp2": recipe_run("cpu_fsdp2_tp2.yaml", "--per_device_train_batch_size", "2", *MOE, setup=save_tiny_moe),
    # ep 2 x tp 2 (world 4): each tp rank's 4 experts split over the 2 dp ranks, outside FSDP2.
    "moe8/reference": recipe_run(None, "--per_device_train_batch_size", "4", *MOE, setup=save_tiny_moe8),
    "moe8/ep2xtp2": recipe_run("cpu_fsdp2_tp2.yaml", "--per_device_train_batch_size", "2", *MOE, *RESUME_FROM,
                               setup=save_tiny_moe8, env=EP2),
    "moe8/tp2-from-ep2xtp2": recipe_run("cpu_fsdp2_tp2.yaml", "--per_device_train_batch_size", "2", *MOE,
                                        "--resume_from_checkpoint", "{out:moe8/ep2xtp2}/checkpoint-2", setup=save_tiny_moe8,
                                        after=("moe8/ep2xtp2",)),
    # Each one's step-2 checkpoint resumed in the other layout.
    "moe/cp2-from-ep2": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *MOE,
                                   "--resume_from_checkpoint", "{out:moe/ep2-cp2}/checkpoint-2", setup=save_tiny_moe,
                                   after=("moe/ep2-cp2",)),
    "moe/ep2-from-cp2": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *MOE,
                                   "--resume_from_checkpoint", "{out:moe/cp2}/checkpoint-2", setup=save_tiny_moe,
                                   env=EP2, after=("moe/cp2",)),
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


@runs("moe/reference", "moe/ep2-cp2")
def test_a_qwen35_moe_model_under_ep2_and_cp2_trains_as_one_process_and_saves_every_expert(launched):
    """QWEN35_ACCEL_EP=2 with cpu_fsdp2_cp2.yaml: each rank holds 3 of the 6 experts of every layer
    and its chunks of every row; tokens cross to their experts' rank and back (before: no ep)."""
    run, reference = launched("moe/ep2-cp2"), launched("moe/reference")
    lines = [line for line in run.stderr.splitlines() if PREPARED in line]
    assert len(lines) == 1 and "cp=2" in lines[0], run.stderr
    assert "ep=2 (experts: 3 of 6 per rank per layer, all-to-all; their FSDP2 units over 1 rank)" in lines[0], lines[0]
    assert_same_training(run.out, reference.out, rtol=1e-5)
    from safetensors.torch import load_file

    saved = load_file(run.out / "model.safetensors")
    assert {key.split(".")[5] for key in saved if key.startswith("model.layers.0.mlp.experts.")} == set("012345")


@runs("moe/ep2-cp2", "moe/cp2-from-ep2", "moe/cp2", "moe/ep2-from-cp2")
def test_a_checkpoint_saved_under_ep2_resumes_without_ep_and_back(launched):
    """The Trainer's step-2 checkpoint (model and optimizer state, gathered whole) of the ep 2 run
    resumes under cp 2 without ep, and the cp 2 run's under ep 2: steps 3-4 repeat the uninterrupted
    run's losses and grad norms, and the saved weights equal (fp32 rtol 1e-5: the layouts sum the
    experts' gradients in another order; plain SGD, see test_trainer_launch)."""
    _assert_resumed(launched, (("moe/cp2-from-ep2", "moe/ep2-cp2"), ("moe/ep2-from-cp2", "moe/cp2")))


def _assert_resumed(launched, pairs: tuple[tuple[str, str], ...]) -> None:
    """Each (resumed, uninterrupted) pair: steps 3-4's losses and grad norms and the saved weights equal."""
    for resumed, full in pairs:
        a, b = launched(resumed), launched(full)
        assert (b.out / "checkpoint-2").is_dir()
        assert ("ep=2 (experts" in a.stderr) is ("from-cp2" in resumed), a.stderr[-2000:]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(losses(a.out, key)[-2:]), torch.tensor(losses(b.out, key)[-2:]),
                                       rtol=1e-5, atol=0, msg=lambda m, key=key: f"{resumed} {key}: {m}")
        from safetensors.torch import load_file

        got, want = load_file(a.out / "model.safetensors"), load_file(b.out / "model.safetensors")
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{resumed} {key}: {m}")


def test_trl_sft_cli_on_moe_under_cp2_and_ep2_logs_what_one_process_logs(tmp_path):
    """TRL's own `trl sft` (SFTConfig's defaults: Transformers' gradient checkpointing, the prompt
    masked) on a tiny Qwen3.5-MoE, unchanged: one process against `--accelerate_config
    cpu_fsdp2_cp2.yaml` with QWEN35_ACCEL_EP=2 (each rank its chunks of every row and 3 of the 6
    experts of every layer): loss, grad norm, entropy, mean_token_accuracy, num_tokens."""
    import shutil

    from _parity import assert_same_log_history, log_history
    from _trl_cli import RECIPES, four_sgd_steps, single_and_cp2
    from transformers import AutoTokenizer

    model, data = tmp_path / "model", tmp_path / "data"
    save_tiny_moe(model)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(model)
    data.mkdir()
    shutil.copy(RECIPES / "data" / "sft_tiny.jsonl", data / "train.jsonl")
    single, cp2, output = single_and_cp2(tmp_path, "sft", four_sgd_steps(model, data), step=4, cp2_env=EP2)
    assert output.count("prepared by qwen35_accel") == 1 and "cp=2" in output and "ep=2 (experts: 3 of 6" in output, output[-3000:]
    logged = log_history(single)
    losses = [e["loss"] for e in logged if "loss" in e]
    assert len(losses) == 4 and losses[-1] < losses[0] and any(e.get("mean_token_accuracy", 0) > 0 for e in logged), logged
    # fp32 rtol 1e-5: the reduction order of cp's per-chunk partial gradients and of the experts' (ep).
    assert_same_log_history(cp2, single, rtol=1e-5, atol=1e-6)


@runs("moe/reference", "moe/dp2xtp2")
def test_a_qwen35_moe_model_under_dp2_x_tp2_trains_as_one_process(launched):
    """cpu_fsdp2_tp2.yaml (before: Accelerate's own path, Transformers' TP plan, gates as loaded):
    each tp rank holds half the heads, half the shared expert and 3 of the 6 routed experts."""
    run, reference = launched("moe/dp2xtp2"), launched("moe/reference")
    lines = [line for line in run.stderr.splitlines() if PREPARED in line]
    assert len(lines) == 1 and "Qwen3_5MoeForCausalLM prepared by qwen35_accel" in lines[0] and "tp=2" in lines[0], run.stderr
    assert "experts: 3 of 6 per rank per layer, split over the tp ranks" in lines[0], lines[0]
    assert_same_training(run.out, reference.out, rtol=1e-5)


@runs("moe8/reference", "moe8/ep2xtp2", "moe8/tp2-from-ep2xtp2")
def test_a_qwen35_moe_model_under_ep2_x_tp2_trains_as_one_process_and_resumes_under_tp2(launched):
    """cpu_fsdp2_tp2.yaml with QWEN35_ACCEL_EP=2: every rank holds 2 of the 8 experts of each layer,
    whole, the Trainer's gradient norm (clipped at its default 1.0) spans the tp ranks' pieces
    (every gradient lives on one device mesh), and the saved weights are one process's; its step-2
    checkpoint resumes under tp 2 without ep (the experts FSDP2-sharded again) as if uninterrupted."""
    run, reference = launched("moe8/ep2xtp2"), launched("moe8/reference")
    lines = [line for line in run.stderr.splitlines() if PREPARED in line]
    assert len(lines) == 1 and "tp=2" in lines[0], run.stderr
    assert "ep=2 (experts: 2 of 8 per rank per layer, split over ep 2 x tp 2" in lines[0], lines[0]
    assert_same_training(run.out, reference.out, rtol=1e-5)
    _assert_resumed(launched, (("moe8/tp2-from-ep2xtp2", "moe8/ep2xtp2"),))
