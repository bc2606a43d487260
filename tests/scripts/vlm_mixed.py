"""A plain Trainer script on a mixed image/video/text dataset: some rows carry an image or a
video, the rest only text, and the collator gives `pixel_values`/`image_grid_thw` (and
`pixel_values_videos`/`video_grid_thw`) only for the rows that have them.

    [accelerate launch --config_file …] tests/scripts/vlm_mixed.py OUT_DIR --per_device_train_batch_size N [--frozen_tower]

The tiny Qwen3.5 VLM (`build_tiny_vlm`), SGD, 4 optimizer steps of 2 micro-steps each, data in
order (`train_sampling_strategy="sequential"`): with 2 ranks of 2 rows, micro-step by micro-step
the ranks hold images / text, text / an image and a video, text / text, a video / text, so
every step mixes ranks with and without images. One process with 4 rows per device computes
the same global batches. The Trainer writes the logged losses and grad norms to
OUT_DIR/trainer_state.json.
"""

import argparse

import torch
from transformers import Trainer, TrainingArguments

from qwen35_accel.testing.tiny import build_tiny_vlm, concat_vlm_batches, mixed_vlm_batch, tiny_vlm_config

SEQ = 16
# Per micro-step: the 4 rows of the global batch (rank 0 gets the first 2 under 2 ranks).
MICRO_STEPS = [
    ["image", "image", None, None],
    [None, None, "image", "video"],
    [None, None, None, None],
    ["video", None, None, None],
]


class MixedRows(torch.utils.data.Dataset):
    """Each item one row as a collator-style batch of 1 (`mixed_vlm_batch`)."""

    def __init__(self, steps: int) -> None:
        config = tiny_vlm_config()
        media = [kind for step in range(steps) for kind in MICRO_STEPS[step % len(MICRO_STEPS)]]
        self.rows = [mixed_vlm_batch(config, [kind], SEQ, seed=1000 + i) for i, kind in enumerate(media)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--per_device_train_batch_size", type=int, required=True)
    parser.add_argument("--frozen_tower", action="store_true", help="freeze the vision tower")
    cli = parser.parse_args()
    model = build_tiny_vlm(seed=0)
    if cli.frozen_tower:
        model.model.visual.requires_grad_(False)
    args = TrainingArguments(
        output_dir=cli.output_dir, per_device_train_batch_size=cli.per_device_train_batch_size, gradient_accumulation_steps=2,
        max_steps=4, logging_steps=1, optim="sgd", learning_rate=0.3, seed=0, report_to="none", save_strategy="no",
        remove_unused_columns=False, disable_tqdm=True, train_sampling_strategy="sequential",
    )
    trainer = Trainer(model=model, args=args, train_dataset=MixedRows(steps=8), data_collator=concat_vlm_batches)
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main()
