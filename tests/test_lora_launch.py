"""LoRA through the Trainer: `accelerate launch … recipes/sft.py --lora` against one process.

Per-step losses and grad norms from `trainer_state.json`; the adapter from the PEFT adapter
directory `Trainer.save_model` writes (loaded back with `PeftModel.from_pretrained`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qwen35_accel.testing.launch import (
    CONFIGS,
    RECIPE,
    accelerate_launch_command,
    describe,
    run_launch,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch: each test launches worlds

PREPARED = "PeftModelForCausalLM prepared by qwen35_accel"
# SGD: a weight differs from the reference exactly as much as its summed gradients (see
# test_trainer_launch.py); lr 1.0 because LoRA's zero-initialised lora_B moves slowly.
COMMON = ["--lora", "--max_steps", "4", "--logging_steps", "1", "--seed", "0", "--optim", "sgd", "--learning_rate", "1.0"]


def _checked(result):
    assert result.returncode == 0, describe(result)
    assert not result.leftover_processes, f"ranks outlived the launcher\n{describe(result)}"
    return result


def logged(out: Path, key: str) -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry[key] for entry in history if "loss" in entry]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora_single")
    _checked(run_launch([sys.executable, str(RECIPE), *COMMON, "--output_dir", str(out), "--per_device_train_batch_size", "4"]))
    return out


@pytest.mark.parametrize(
    "config,per_device,state_dict_type,rtol",
    [
        ("cpu_fsdp2.yaml", "2", "FULL_STATE_DICT", 1e-5),
        ("cpu_fsdp2.yaml", "2", "SHARDED_STATE_DICT", 1e-5),
        ("cpu_fsdp2_cp2.yaml", "4", "FULL_STATE_DICT", 1e-4),
        ("cpu_fsdp2_dp2_cp2.yaml", "2", "FULL_STATE_DICT", 1e-4),
        ("cpu_fsdp2_tp2.yaml", "2", "FULL_STATE_DICT", 1e-4),
    ],
    ids=["fsdp2", "fsdp2-sharded-state-dict", "cp2", "dp2xcp2", "dp2xtp2"],
)
def test_lora_launch_trains_as_one_process_and_saves_the_same_adapter(reference, tmp_path, config, per_device, state_dict_type, rtol):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    yaml = tmp_path / "config.yaml"
    yaml.write_text((CONFIGS / config).read_text().replace("FULL_STATE_DICT", state_dict_type))
    out = tmp_path / "run"
    result = _checked(run_launch(accelerate_launch_command(
        str(yaml), RECIPE, *COMMON, "--output_dir", str(out), "--per_device_train_batch_size", per_device
    )))
    assert PREPARED in result.stderr
    # fp32 rtol 1e-5: FSDP2's reduction order; 1e-4 under CP / TP (per-chunk or per-head
    # partial gradients reduced over cp / tp, carried into later losses by 4 SGD steps), as
    # for full fine-tuning.
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(logged(out, key)), torch.tensor(logged(reference, key)), rtol=rtol, atol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert logged(out, "loss")[-1] < logged(out, "loss")[0]

    got, want = load_file(out / "adapter_model.safetensors"), load_file(reference / "adapter_model.safetensors")
    assert set(got) == set(want) and all("lora_" in k for k in want)
    for key in want:
        # Adapter weights after 4 SGD steps: the summed gradients' rtol, atol for near-zero entries.
        torch.testing.assert_close(got[key], want[key], rtol=rtol, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")

    config_dir = RECIPE.parent / "configs" / "tiny_qwen35.json"
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config_dir)))
    merged = PeftModel.from_pretrained(base, out).merge_and_unload()
    assert merged.model.layers[0].linear_attn.A_log.dtype == torch.float32


def test_lora_resume_from_checkpoint_continues_with_the_uninterrupted_losses(tmp_path):
    launch = lambda out, *args: _checked(run_launch(accelerate_launch_command(
        "cpu_fsdp2.yaml", RECIPE, "--lora", "--max_steps", "4", "--logging_steps", "1", "--seed", "0",
        "--learning_rate", "1.0", "--per_device_train_batch_size", "2", "--output_dir", str(out), *args)))
    full = tmp_path / "full"
    launch(full, "--save_strategy", "steps", "--save_steps", "2")
    resumed = tmp_path / "resumed"
    launch(resumed, "--resume_from_checkpoint", str(full / "checkpoint-2"))
    # AdamW (the Trainer's default) and its state come back from the checkpoint; same layout on
    # both sides, only the round trip differs: fp32 rtol 1e-5.
    torch.testing.assert_close(torch.tensor(logged(resumed, "loss")[-2:]), torch.tensor(logged(full, "loss")[-2:]),
                               rtol=1e-5, atol=0)
