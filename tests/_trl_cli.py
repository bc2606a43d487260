"""TRL's own CLIs (`trl sft|dpo|grpo`), unchanged, as a user runs them: one command without an
Accelerate config (one process) and the same command with `--accelerate_config` naming the cp 2
YAML, each writing a checkpoint whose log history the tests compare."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from qwen35_accel.local_world import free_port
from qwen35_accel.testing.launch import CONFIGS, REPO, run_to_completion

RECIPES = REPO / "recipes"


def saved_tiny_model(folder: Path, eos_token_ids: Sequence[int] = ()) -> Path:
    """The recipes' tiny Qwen3.5 (seed 0, fp32) and byte-level tokenizer saved to `folder`, as
    `--model_name_or_path` takes them; `eos_token_ids` are added to its generation config's EOS."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed

    tokenizer = AutoTokenizer.from_pretrained(RECIPES / "configs" / "tokenizer")
    set_seed(0)
    config = AutoConfig.from_pretrained(RECIPES / "configs" / "tiny_qwen35.json")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if eos_token_ids:
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *eos_token_ids]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def four_sgd_steps(model: Path, data: Path) -> list[str]:
    """The trainer arguments the `trl sft` and `trl dpo` tests share: 4 SGD steps at a constant lr 0.3,
    4 rows a step, every step logged, one checkpoint (`checkpoint-4`), fp32, rows padded to 8."""
    return [
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--max_steps", "4",
        "--per_device_train_batch_size", "4", "--optim", "sgd", "--learning_rate", "0.3", "--lr_scheduler_type", "constant",
        "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "4", "--save_only_model", "True",
        "--report_to", "none", "--seed", "0", "--dataloader_drop_last", "True", "--max_length", "64",
        "--pad_to_multiple_of", "8", "--bf16", "False",
    ]


def single_and_cp2(root: Path, command: str, args: Sequence[str], step: int, cp2_env: dict[str, str] | None = None,
                   config: str = "cpu_fsdp2_cp2.yaml", single_args: Sequence[str] = (),
                   launched_args: Sequence[str] = ()) -> tuple[Path, Path, str]:
    """`trl COMMAND ARGS SINGLE_ARGS` in one process (output in root/single), then `trl COMMAND ARGS
    LAUNCHED_ARGS` with the Accelerate `config` (the cp 2 YAML by default; root/cp2; `cp2_env` added to
    its environment). HF_HOME lies in `root`, so no user default Accelerate config applies to the first;
    `root` is on PYTHONPATH (a reward function by dotted path). Returns both `checkpoint-STEP` folders
    and the launched run's output."""
    trl = [sys.executable, "-m", "trl.cli.main", command]  # the `trl` console script's entry point
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {"HF_HOME": str(root / "hf"), "PYTHONPATH": path}
    run_to_completion([*trl, *args, *single_args, "--output_dir", str(root / "single")], env)
    output = run_to_completion([*trl, *args, *launched_args, "--output_dir", str(root / "cp2"), "--accelerate_config",
                               str(CONFIGS / config), "--main_process_port", str(free_port())],
                               {**env, **(cp2_env or {})})
    return root / "single" / f"checkpoint-{step}", root / "cp2" / f"checkpoint-{step}", output
