"""A plain Trainer script on an image/video/text dataset, for launches under context parallelism.

    [accelerate launch --config_file …] tests/scripts/vlm_cp.py OUT_DIR [--frozen_tower] [--packed]

The tiny Qwen3.5 VLM (`build_tiny_vlm`), SGD, 2 optimizer steps of 2 micro-steps of 2 rows,
data in order; then `evaluate()` (loss, and `compute_metrics` on the logits) and `predict()`
on 6 rows. Rows of 30 tokens (padded to 32 under cp 2: four chunks of 8) with images of
different sizes whose tokens straddle chunk boundaries, a video, a right-padded row, a
text-only row; the collator gives `input_ids`, `attention_mask`, `labels`, `mm_token_type_ids`,
`pixel_values`, `image_grid_thw` (and the video keys) as a Qwen3.5 VLM collator does. Rank 0
writes OUT_DIR/trainer_state.json (losses, grad norms, eval metrics), OUT_DIR/predictions.pt (predict()'s
logits and label ids, and the predicted rows' attention mask).
`--packed`: the collator adds `position_ids` restarting mid-row (two documents per row).
"""

import argparse
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from qwen35_accel.testing.tiny import build_tiny_vlm, concat_vlm_batches, placed_vlm_batch, tiny_vlm_config

SEQ = 30
# (rows' items, right padding): (kind, first token, h, w), h*w/4 tokens.
ROWS = [
    ([("image", 3, 4, 8)], 0),  # tokens 3..10: across the boundary at 8
    ([("video", 5, 4, 4), ("image", 14, 8, 4)], 3),
    ([], 0),
    ([("image", 21, 4, 4)], 0),  # tokens 21..24: across the boundary at 24
]


class PlacedRows(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int) -> None:
        config = tiny_vlm_config()
        self.rows = [placed_vlm_batch(config, [ROWS[i % len(ROWS)][0]], SEQ, seed + i, [ROWS[i % len(ROWS)][1]])
                     for i in range(count)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def preprocess_logits_for_metrics(logits, labels):
    return logits[0] if isinstance(logits, tuple) else logits  # the VLM returns image outputs too


def compute_metrics(eval_preds):
    logits, labels = eval_preds
    preds, labels = logits.argmax(-1)[:, :-1].reshape(-1), labels[:, 1:].reshape(-1)
    keep = labels != -100
    return {"accuracy": float((preds[keep] == labels[keep]).mean()), "counted": int(keep.sum())}


def packed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    positions = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ - SEQ // 2)]).expand(batch["input_ids"].shape[0], -1)
    return {**batch, "position_ids": positions}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--frozen_tower", action="store_true")
    parser.add_argument("--packed", action="store_true")
    cli = parser.parse_args()
    model = build_tiny_vlm(seed=0)
    if cli.frozen_tower:
        model.model.visual.requires_grad_(False)
    args = TrainingArguments(
        output_dir=cli.output_dir, per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=2,
        max_steps=2, logging_steps=1, optim="sgd", learning_rate=0.3, seed=0, report_to="none", save_strategy="no",
        remove_unused_columns=False, disable_tqdm=True, train_sampling_strategy="sequential",
    )
    collator = (lambda rows: packed(concat_vlm_batches(rows))) if cli.packed else concat_vlm_batches
    trainer = Trainer(model=model, args=args, train_dataset=PlacedRows(8, seed=300), eval_dataset=PlacedRows(6, seed=400),
                      data_collator=collator, compute_metrics=compute_metrics,
                      preprocess_logits_for_metrics=preprocess_logits_for_metrics)
    trainer.train()
    trainer.evaluate()
    predict_rows = PlacedRows(6, seed=400)
    predictions = trainer.predict(predict_rows)
    trainer.save_state()
    if trainer.is_world_process_zero():
        attention_mask = torch.cat([row["attention_mask"] for row in predict_rows.rows])
        torch.save({"logits": torch.as_tensor(predictions.predictions), "label_ids": torch.as_tensor(predictions.label_ids),
                    "attention_mask": attention_mask},
                   Path(cli.output_dir) / "predictions.pt")


if __name__ == "__main__":
    main()
