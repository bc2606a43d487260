"""Trainer evaluation and prediction as Transformers' `run_clm.py --do_eval` does them, on the tiny model.

    [accelerate launch --config_file …] tests/scripts/eval_clm.py OUT_DIR --per_device_eval_batch_size N [--no_train]

`--no_train`: evaluate and predict the freshly built model (the Trainer prepares it for
evaluation alone); otherwise one training step with lr 0 comes first, as run_clm.py's
`--do_train --do_eval`.

A plain Trainer script (it never imports qwen35_accel's plugin API): the recipe's tiny
Qwen3.5 (weights made deterministic and sharp enough that argmax ties cannot flip), the
bundled data padded to a fixed length, `compute_metrics` / `preprocess_logits_for_metrics`
as in run_clm.py (accuracy of the shifted argmax, prompt tokens masked). Rank 0 writes
OUT_DIR/results.json (every metrics dict) and OUT_DIR/predictions.pt (`predict()` outputs).
"""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

from qwen35_accel.testing.tiny import randomize_for_parity

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "sft.py"
SEQ = 64
ROWS_EVEN, ROWS_REMAINDER = 16, 13  # 16: no partial last batch; 13: a remainder at every batch size used


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):  # as run_clm.py: the model may return extra tensors
        logits = logits[0]
    return logits.argmax(dim=-1)


def accuracy(preds: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)  # run_clm.py's shift
    keep = labels != -100
    # The random model gets few right: the checksum of the predicted ids shows any misplaced or duplicated row.
    return {"accuracy": float((preds[keep] == labels[keep]).mean()), "counted": int(keep.sum()),
            "pred_checksum": int((preds[keep].astype(np.int64) * (1 + np.arange(keep.sum()) % 7)).sum())}


def compute_metrics_from_argmax(eval_preds):
    preds, labels = eval_preds
    return accuracy(preds, labels)


def compute_metrics_from_logits(eval_preds):
    logits, labels = eval_preds
    if isinstance(logits, tuple):
        logits = logits[0]
    return accuracy(logits.argmax(-1), labels)


def main(out: str, per_device_eval_batch_size: int) -> None:
    spec = importlib.util.spec_from_file_location("sft_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    script_args, _ = recipe.parse_args(["--output_dir", out])
    tokenizer = recipe.load_tokenizer(script_args)
    model = recipe.load_model(script_args, seed=0)
    with torch.no_grad():
        randomize_for_parity(model, seed=0)
        model.lm_head.weight.mul_(30)  # logit gaps of order 1: argmax decided far above fp32 noise
    args = TrainingArguments(
        output_dir=out, per_device_eval_batch_size=per_device_eval_batch_size, report_to="none",
        remove_unused_columns=False, disable_tqdm=True, eval_do_concat_batches=True,
        # One training step with lr 0 (unless --no_train), as `run_clm.py --do_train --do_eval`: the model is
        # prepared with its optimizer, and the weights stay unchanged.
        max_steps=1, per_device_train_batch_size=2, learning_rate=0.0, optim="sgd", save_strategy="no",
    )
    data = recipe.build_dataset(script_args, args, tokenizer)
    collator = DataCollatorForSeq2Seq(tokenizer, padding="max_length", max_length=SEQ, label_pad_token_id=-100, return_tensors="pt")
    even, remainder = data.select(range(ROWS_EVEN)), data.select(range(ROWS_REMAINDER))
    unlabeled = remainder.remove_columns(["labels"])

    trainer = Trainer(model=model, args=args, data_collator=collator, train_dataset=data, compute_metrics=compute_metrics_from_argmax,
                      preprocess_logits_for_metrics=preprocess_logits_for_metrics)
    if "--no_train" not in sys.argv:
        trainer.train()
    results = {
        "argmax_even": trainer.evaluate(even),
        "argmax_remainder": trainer.evaluate(remainder),
    }
    trainer.compute_metrics, trainer.preprocess_logits_for_metrics = compute_metrics_from_logits, None
    results["logits_remainder"] = trainer.evaluate(remainder)
    trainer.compute_metrics = None
    results["loss_only_even"] = trainer.evaluate(even)
    labeled = trainer.predict(remainder)
    plain = trainer.predict(unlabeled)
    if trainer.is_world_process_zero():
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "results.json").write_text(json.dumps(results, indent=1))
        first = lambda p: p[0] if isinstance(p, tuple) else p
        torch.save(
            {"labeled": torch.as_tensor(first(labeled.predictions)), "label_ids": torch.as_tensor(labeled.label_ids),
             "unlabeled": torch.as_tensor(first(plain.predictions))},
            Path(out) / "predictions.pt",
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[sys.argv.index("--per_device_eval_batch_size") + 1]))
