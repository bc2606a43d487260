"""Trainer level: `accelerate launch --config_file accelerate_configs/… recipes/sft.py`,
unchanged script, against one process without Accelerate launch.

Each run is a real subprocess (the plugin activates itself through the torch entry
point). Per-step losses come from the Trainer's own `trainer_state.json`, final
weights from the saved Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _parity import assert_same_log_history
from safetensors.torch import load_file

from qwen35_accel.testing.launch import CONFIGS, RECIPE, accelerate_launch_command, describe, run_launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch: each test launches worlds

PREPARED = "prepared by qwen35_accel"
COMMON = ["--max_steps", "4", "--logging_steps", "1", "--seed", "0"]
# Every comparison also checks the logged grad_norm per step: a wrong loss scaling under
# dp/cp shows there first. Weights are compared after plain SGD: AdamW's update
# lr * m / (sqrt(v) + eps) turns reduction-order noise in a near-zero gradient (heads
# whose state decays within one token, A = exp(A_log) ~ 15 in the tiny init, get
# |dL/dA_log| ~ 1e-10) into a step of order lr whose sign the rounding decides; under SGD
# a weight differs from the reference exactly as much as its summed gradients did.
SGD = ["--optim", "sgd", "--learning_rate", "0.3"]
# Every batch 62 positions long (the longest example has 57 tokens) on every rank: the ranks'
# batch shapes add up to one process's, so the Trainer's total_flos (it counts positions,
# padding included) compares exactly; 62 is not a multiple of 2·cp, so under cp the Trainer
# patch point still pads the collator's BatchEncoding.
FIXED_LENGTH = ["--pad_to_multiple_of", "62"]


def _checked(result):
    assert result.returncode == 0, describe(result)
    assert not result.leftover_processes, f"ranks outlived the launcher\n{describe(result)}"
    return result


def launch(config: str, out: Path, *args: str):
    return _checked(run_launch(accelerate_launch_command(config, RECIPE, *COMMON, "--output_dir", str(out), *args)))


def single(out: Path, *args: str):
    return _checked(run_launch([sys.executable, str(RECIPE), *COMMON, "--output_dir", str(out), *args]))


def losses(out: Path, key: str = "loss") -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry[key] for entry in history if "loss" in entry]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def assert_same_training(actual: Path, expected: Path, rtol: float, weight_atol: float = 1e-6, flos: bool = False) -> None:
    assert len(losses(expected)) == 4 and losses(expected)[-1] < losses(expected)[0]
    # Every value the Trainer logged (loss, grad_norm, learning_rate, epoch, train_loss) per
    # step; with `flos`, total_flos (Transformers sums the ranks' counts in float32: exact for
    # the tiny model's).
    assert_same_log_history(actual, expected, rtol=rtol, flos=flos)
    a, b = weights(actual), weights(expected)
    assert set(a) == set(b)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=weight_atol, msg=lambda m, key=key: f"{key}: {m}")
    assert a["model.layers.0.linear_attn.A_log"].dtype == torch.float32


@pytest.fixture(scope="module")
def reference_sgd(tmp_path_factory) -> Path:
    """One process, no launcher: per-device batch 4 = the global batch of every launch below."""
    out = tmp_path_factory.mktemp("single_sgd")
    single(out, "--per_device_train_batch_size", "4", *FIXED_LENGTH, *SGD)
    return out


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_fsdp2_on_two_cpu_processes_matches_one_process_and_saves_a_loadable_checkpoint(reference_sgd, tmp_path, state_dict_type):
    from transformers import AutoModelForCausalLM

    config = tmp_path / "config.yaml"  # the shipped config, with the state dict type under test
    config.write_text((CONFIGS / "cpu_fsdp2.yaml").read_text().replace("FULL_STATE_DICT", state_dict_type))
    out = tmp_path / "fsdp2"
    result = launch(str(config), out, "--per_device_train_batch_size", "2", *FIXED_LENGTH, *SGD)
    assert PREPARED in result.stderr and "FSDP2 runs on CPU over gloo" in result.stderr
    # fp32 rtol 1e-5: FSDP2 sums the two ranks' gradients in another order than one process.
    assert_same_training(out, reference_sgd, rtol=1e-5, flos=True)

    model = AutoModelForCausalLM.from_pretrained(out)
    expected = AutoModelForCausalLM.from_pretrained(reference_sgd)
    assert model.model.layers[0].linear_attn.A_log.dtype == torch.float32
    ids = torch.arange(1, 33).reshape(2, 16)
    # The weights matched at rtol 1e-5 / atol 1e-6 above; logits of 16 tokens through 3 layers: atol 1e-5.
    torch.testing.assert_close(model(input_ids=ids).logits, expected(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "config,per_device,shows",
    [("cpu_fsdp2_cp2.yaml", "4", "cp=2"), ("cpu_fsdp2_dp2_cp2.yaml", "2", "cp=2"), ("cpu_fsdp2_tp2.yaml", "2", "tp=2")],
    ids=["cp2", "dp2xcp2", "dp2xtp2"],
)
def test_context_and_tensor_parallel_launches_match_one_process(reference_sgd, tmp_path, config, per_device, shows):
    """Losses, grad norms, weights, and total_flos: the ranks of a cp or tp group hold one
    batch, which the Trainer must count once, with the whole model's parameters."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    result = launch(config, out, "--per_device_train_batch_size", per_device, *FIXED_LENGTH, *SGD)
    assert PREPARED in result.stderr and shows in result.stderr
    # rtol 1e-4: under CP every gradient is a sum of per-chunk partials reduced over cp (and dp),
    # and 4 SGD steps at lr 0.3 carry those reduction-order differences into the later losses.
    assert_same_training(out, reference_sgd, rtol=1e-4, flos=True)
    assert AutoModelForCausalLM.from_pretrained(out).model.layers[0].linear_attn.A_log.dtype == torch.float32


@pytest.mark.parametrize("form", [[], ["--packing_flash_attn_kwargs"]], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize(
    "config,per_device,rtol",
    # fp32 rtol 1e-5: FSDP2's reduction order, and each document's kernels batched with others;
    # rtol 1e-4 under CP: as for the CP launches above (per-chunk partials over 4 SGD steps).
    [("cpu_fsdp2.yaml", "2", 1e-5), ("cpu_fsdp2_cp2.yaml", "4", 1e-4)],
    ids=["fsdp2", "cp2"],
)
def test_packed_rows_through_a_launch_train_exactly_as_padded_rows_in_one_process(
    reference_sgd, tmp_path, form, config, per_device, rtol
):
    """DataCollatorWithFlattening (one row per rank, documents restarting their positions)
    under FSDP2 on 2 processes, and under cp 2 (the row, of any length, padded to 2·cp by
    the Trainer patch point and split across the ranks), against the padded single-process
    run: packing computes every example on its own, so nothing but the layout may differ."""
    out = tmp_path / "packed"
    result = launch(config, out, "--per_device_train_batch_size", per_device, "--packing", *form, *SGD)
    assert PREPARED in result.stderr
    assert_same_training(out, reference_sgd, rtol=rtol)


def test_resume_from_checkpoint_continues_with_the_uninterrupted_losses(tmp_path):
    full = tmp_path / "full"
    launch("cpu_fsdp2.yaml", full, "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "2")
    checkpoint = full / "checkpoint-2"
    assert checkpoint.is_dir()
    resumed = tmp_path / "resumed"
    launch(
        "cpu_fsdp2.yaml", resumed, "--per_device_train_batch_size", "2", "--resume_from_checkpoint", str(checkpoint)
    )
    # Same layout on both sides; only the checkpoint round trip differs: fp32 rtol 1e-5.
    torch.testing.assert_close(torch.tensor(losses(resumed)[-2:]), torch.tensor(losses(full)[-2:]), rtol=1e-5, atol=0)


def save_tiny_llama(path: Path) -> None:
    """A tiny random Llama (the recipe's byte-level tokenizer fits it): a model the plugin leaves alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, eos_token_id=256, pad_token_id=256)
    ).save_pretrained(path)


def test_other_models_keep_accelerates_own_fsdp2_path_through_the_same_launch(tmp_path):
    llama_dir = tmp_path / "llama"
    save_tiny_llama(llama_dir)
    out = tmp_path / "llama_out"
    result = launch(
        "cpu_fsdp2.yaml", out, "--model_name_or_path", str(llama_dir),
        "--tokenizer_name_or_path", str(RECIPE.parent / "configs" / "tokenizer"), "--per_device_train_batch_size", "2",
    )
    assert PREPARED not in result.stderr and "FSDP2 runs on CPU over gloo" in result.stderr
    history = losses(out)
    assert history[-1] < history[0]


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_resuming_a_tensor_parallel_run_continues_with_the_uninterrupted_training(tmp_path, state_dict_type):
    """dp 2 x tp 2: the Trainer's periodic checkpoint (model + AdamW state, Transformers
    layout) resumes into the per-head slices; steps 3-4 and the final weights repeat."""
    config = tmp_path / "config.yaml"
    config.write_text((CONFIGS / "cpu_fsdp2_tp2.yaml").read_text().replace("FULL_STATE_DICT", state_dict_type))
    full = tmp_path / "full"
    launch(str(config), full, "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "2")
    resumed = tmp_path / "resumed"
    launch(str(config), resumed, "--per_device_train_batch_size", "2",
           "--resume_from_checkpoint", str(full / "checkpoint-2"))
    # Same dp x tp layout and AdamW on both sides (one reduction order); only the checkpoint
    # round trip (gather to Transformers' layout, slice on load) differs: fp32 rtol 1e-5.
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(losses(resumed, key)[-2:]), torch.tensor(losses(full, key)[-2:]),
                                   rtol=1e-5, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    a, b = weights(resumed), weights(full)
    assert set(a) == set(b)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
