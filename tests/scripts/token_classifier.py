"""A token classifier trained with the plain Trainer, as a user writes it: `AutoModelForTokenClassification`
(3 labels) from a saved checkpoint, rows of 30 positions right-padded with the pad token 0, a label per
real token (-100 on padding), the Trainer's default collator, 2 SGD steps and an evaluation on 8 rows (its
global batch the training's), every value in `trainer_state.json` and the weights saved.

    [accelerate launch --config_file …] tests/scripts/token_classifier.py MODEL_DIR OUTPUT_DIR PER_DEVICE [ACCUMULATION]
"""

import sys

import torch
from transformers import AutoModelForTokenClassification, Trainer, TrainingArguments

LENGTH = 30


def rows(count: int = 64) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        real = int(torch.randint(4, LENGTH + 1, (1,), generator=generator))
        ids = torch.randint(1, 80, (real,), generator=generator).tolist()  # below the VLM config's special tokens
        labels = torch.randint(0, 3, (real,), generator=generator).tolist()
        pad = LENGTH - real
        out.append({"input_ids": ids + [0] * pad, "attention_mask": [1] * real + [0] * pad, "labels": labels + [-100] * pad})
    return out


def main(model_dir: str, out: str, per_device: int, accumulation: int) -> None:
    model = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, max_steps=2, optim="sgd", learning_rate=0.3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", seed=0,
        dataloader_drop_last=True, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=per_device * accumulation,
    )
    data = rows()
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8])
    trainer.train()
    trainer.save_model(out)
    trainer.save_state()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 1)
