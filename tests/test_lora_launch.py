"""LoRA through the Trainer: `accelerate launch … recipes/sft.py --lora` against one process.

Per-step losses and grad norms from `trainer_state.json`; the adapter from the PEFT adapter
directory `Trainer.save_model` writes (loaded back with `PeftModel.from_pretrained`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _launched import Run, register
from safetensors.torch import load_file

from qwen35_accel.testing.launch import RECIPE

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch: each test launches worlds

PREPARED = "PeftModelForCausalLM prepared by qwen35_accel"
# SGD: a weight differs from the reference exactly as much as its summed gradients (see
# test_trainer_launch.py); lr 1.0 because LoRA's zero-initialised lora_B moves slowly.
COMMON = ["--lora", "--max_steps", "4", "--logging_steps", "1", "--seed", "0", "--optim", "sgd", "--learning_rate", "1.0"]


def runs(*names: str):
    return pytest.mark.launches(*names)


def logged(out: Path, key: str) -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry[key] for entry in history if "loss" in entry]


# One launch per config for the whole module (with the other modules' runs of that config).
CASES = {  # id: config, per-device batch, the FSDP plugin's state dict type, rtol
    "fsdp2": ("cpu_fsdp2.yaml", "2", "FULL_STATE_DICT", 1e-5),
    "fsdp2-sharded-state-dict": ("cpu_fsdp2.yaml", "2", "SHARDED_STATE_DICT", 1e-5),
    "cp2": ("cpu_fsdp2_cp2.yaml", "4", "FULL_STATE_DICT", 1e-4),
    "dp2xcp2": ("cpu_fsdp2_dp2_cp2.yaml", "2", "FULL_STATE_DICT", 1e-4),
    "dp2xtp2": ("cpu_fsdp2_tp2.yaml", "2", "FULL_STATE_DICT", 1e-4),
}
RESUME = ("--lora", "--max_steps", "4", "--logging_steps", "1", "--seed", "0", "--learning_rate", "1.0",
          "--per_device_train_batch_size", "2", "--output_dir", "{out}")
register(**{
    "lora/reference": Run(None, RECIPE, (*COMMON, "--output_dir", "{out}", "--per_device_train_batch_size", "4")),
    **{f"lora/{case}": Run(config, RECIPE, (*COMMON, "--output_dir", "{out}", "--per_device_train_batch_size", per_device),
                           env={"FSDP_STATE_DICT_TYPE": kind})  # what the config's fsdp_state_dict_type sets
       for case, (config, per_device, kind, _) in CASES.items()},
    "lora/resume-full": Run("cpu_fsdp2.yaml", RECIPE, (*RESUME, "--save_strategy", "steps", "--save_steps", "2")),
    "lora/resume-resumed": Run("cpu_fsdp2.yaml", RECIPE, (*RESUME, "--resume_from_checkpoint", "{out:lora/resume-full}/checkpoint-2"),
                               after=("lora/resume-full",)),
})


@pytest.mark.parametrize(
    "case,rtol", [pytest.param(case, c[3], marks=runs("lora/reference", f"lora/{case}"), id=case) for case, c in CASES.items()]
)
def test_lora_launch_trains_as_one_process_and_saves_the_same_adapter(launched, case, rtol):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    run, reference = launched(f"lora/{case}"), launched("lora/reference").out
    out = run.out
    assert PREPARED in run.stderr
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


@runs("lora/resume-full", "lora/resume-resumed")
def test_lora_resume_from_checkpoint_continues_with_the_uninterrupted_losses(launched):
    full, resumed = launched("lora/resume-full").out, launched("lora/resume-resumed").out
    # AdamW (the Trainer's default) and its state come back from the checkpoint; same layout on
    # both sides, only the round trip differs: fp32 rtol 1e-5.
    torch.testing.assert_close(torch.tensor(logged(resumed, "loss")[-2:]), torch.tensor(logged(full, "loss")[-2:]),
                               rtol=1e-5, atol=0)
