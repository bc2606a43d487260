"""TRL's `RewardTrainer` as a user writes it: a reward model (`AutoModelForSequenceClassification`,
num_labels 1) from a saved checkpoint, preference pairs built from the recipes' toy prompt/completion
data (each prompt's completion chosen, the next record's rejected), 3 SGD steps and an evaluation on 8
pairs after the last, every metric TRL and the Trainer log in `trainer_state.json`.

    [accelerate launch --config_file …] tests/scripts/trl_reward.py MODEL_DIR OUTPUT_DIR PER_DEVICE
"""

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import RewardConfig, RewardTrainer

DATA = Path(__file__).resolve().parents[2] / "recipes" / "data" / "sft_tiny.jsonl"


def main(model_dir: str, out: str, per_device: int) -> None:
    records = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    pairs = Dataset.from_list([
        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": records[(i + 1) % len(records)]["completion"]}
        for i, r in enumerate(records)
    ])
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    args = RewardConfig(
        output_dir=out, per_device_train_batch_size=per_device, max_steps=3, optim="sgd", learning_rate=0.3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", seed=0, bf16=False,
        max_length=64, dataloader_drop_last=True, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=pairs, eval_dataset=pairs.select(range(8)),
                            processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
