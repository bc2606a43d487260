"""TRL's `DPOTrainer` with an explicit reference model, as a user writes it: the recipes' tiny
Qwen3.5 as policy and as frozen reference (the same initial weights, two objects), preference
pairs built from the recipes' toy prompt/completion data, 4 SGD steps; losses, reward
metrics and grad norms in `trainer_state.json`.

    [accelerate launch --config_file …] tests/scripts/trl_dpo.py OUTPUT_DIR PER_DEVICE [lora]

With `lora`: no reference model; TRL trains LoRA adapters and takes the reference
log-probabilities from the policy with its adapters disabled.
"""

import sys
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import DPOConfig, DPOTrainer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def tiny_model() -> torch.nn.Module:
    set_seed(0)  # policy and reference start from the same weights
    config = AutoConfig.from_pretrained(RECIPES / "configs" / "tiny_qwen35.json")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def preference_pairs():
    """prompt, chosen = its completion, rejected = the next record's completion."""
    data = load_dataset("json", data_files=str(RECIPES / "data" / "sft_tiny.jsonl"), split="train")
    completions = data["completion"]
    return data.map(
        lambda record, i: {"prompt": record["prompt"], "chosen": record["completion"],
                           "rejected": completions[(i + 1) % len(completions)]},
        with_indices=True, remove_columns=data.column_names,
    )


def main(out: str, per_device: int, lora: bool = False) -> None:
    tokenizer = AutoTokenizer.from_pretrained(RECIPES / "configs" / "tokenizer")
    model, ref_model = tiny_model(), None if lora else tiny_model()
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "in_proj_qkv"])
    args = DPOConfig(
        output_dir=out,
        max_steps=4,
        per_device_train_batch_size=per_device,
        optim="sgd",
        learning_rate=0.3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_drop_last=True,
        bf16=False,  # fp32 makes the comparison exact
        max_length=64,
        pad_to_multiple_of=8,
    )
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=preference_pairs(),
                         processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), lora=sys.argv[3:] == ["lora"])
