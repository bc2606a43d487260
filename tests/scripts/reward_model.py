"""A reward model trained with the plain Trainer, as a user writes it: `AutoModelForSequenceClassification`
(num_labels 1) from a saved checkpoint, regression labels, right-padded rows (pad token 0) of 30
positions, the Trainer's default collator, 4 SGD steps and an evaluation on 8 rows after the last,
every value in `trainer_state.json`, then `predict` on those 8 rows (the scores in `predictions.pt`).
DTYPE (default float32) is the load's; `gates_in_forward.pt` (rank 0) holds every `A_log`/`dt_bias` as the
first training forward computed with it (read where the parameter lives, after FSDP2 gathered it).

    [accelerate launch --config_file …] tests/scripts/reward_model.py MODEL_DIR OUTPUT_DIR PER_DEVICE [ACCUMULATION [DTYPE]]

30 is no multiple of 2·cp: under cp the plugin pads each batch (with the pad token, so the head still
pools the last real token).
"""

import sys

import torch
from transformers import AutoModelForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

LENGTH = 30


def rows(vocab: int, count: int = 64) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        real = int(torch.randint(4, LENGTH + 1, (1,), generator=generator))
        ids = torch.randint(1, vocab, (real,), generator=generator).tolist()
        out.append({"input_ids": ids + [0] * (LENGTH - real), "attention_mask": [1] * real + [0] * (LENGTH - real),
                    "labels": 1.0 + 0.1 * float(torch.randn(1, generator=generator))})  # learnable in 4 steps
    return out


class GatesInForward(TrainerCallback):
    """A test's instrument, not a user's: a pre-hook on each module holding `A_log` (Transformers'
    GatedDeltaNet, or the plugin's fp32 holder) records the gates its first forward reads."""

    def __init__(self, path: str) -> None:
        self.path, self.seen = path, {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for name, module in model.named_modules():
            if "A_log" in module._parameters:
                layer = name.removesuffix("._fp32_params").removeprefix("_orig_mod.")
                module.register_forward_pre_hook(lambda module, _args, layer=layer: self.record(layer, module))

    def record(self, layer: str, module: torch.nn.Module) -> None:
        if f"{layer}.A_log" in self.seen:
            return
        for key in ("A_log", "dt_bias"):
            self.seen[f"{layer}.{key}"] = getattr(module, key).detach().clone()
        if state_is_main() and len(self.seen) == 2 * sum(key.endswith("A_log") for key in self.seen):
            torch.save(self.seen, self.path)


def state_is_main() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def main(model_dir: str, out: str, per_device: int, accumulation: int, dtype: str) -> None:
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, max_steps=4,
        optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", seed=0, dataloader_drop_last=True, eval_strategy="steps", eval_steps=4,
        per_device_eval_batch_size=per_device,
    )
    data = rows(model.config.vocab_size)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8],
                      callbacks=[GatesInForward(f"{out}/gates_in_forward.pt")])
    trainer.train()
    trainer.save_model(out)
    trainer.save_state()
    predictions = torch.as_tensor(trainer.predict(data[:8]).predictions)
    if trainer.is_world_process_zero():
        torch.save(predictions, f"{out}/predictions.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 1,
         sys.argv[5] if len(sys.argv) > 5 else "float32")
