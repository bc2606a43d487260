"""TRL's `GRPOTrainer` with a KL term (`beta` > 0, so TRL loads a reference model), as a user
writes it: the recipes' tiny Qwen3.5 saved to a folder (policy and reference both load it),
the recipes' toy prompts, a length reward, 2 SGD steps; KL, losses and grad norms in
`trainer_state.json`.

    [accelerate launch --config_file …] tests/scripts/trl_grpo.py OUTPUT_DIR PER_DEVICE
"""

import os
import sys
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import GRPOConfig, GRPOTrainer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def reward_length(completions: list[str], **kwargs) -> list[float]:
    return [len(completion) / 10 for completion in completions]


def main(out: str, per_device: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(RECIPES / "configs" / "tokenizer")
    # The same initial weights on every rank, each saved to its own folder (no rank waits for another's).
    model_dir = Path(out) / f"initial-rank{os.environ.get('RANK', '0')}"
    set_seed(0)
    config = AutoConfig.from_pretrained(RECIPES / "configs" / "tiny_qwen35.json")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    prompts = load_dataset("json", data_files=str(RECIPES / "data" / "sft_tiny.jsonl"), split="train")
    args = GRPOConfig(
        output_dir=out,
        max_steps=2,
        per_device_train_batch_size=per_device,
        num_generations=4,
        max_completion_length=8,
        beta=0.1,
        optim="sgd",
        learning_rate=0.1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        bf16=False,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward_length, args=args,
                          train_dataset=prompts.select_columns(["prompt"]), processing_class=tokenizer)
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
