"""TRL's `KTOTrainer` with an explicit reference model, as a user writes it: the recipes' tiny
Qwen3.5 as policy and as frozen reference (the same initial weights, two objects), unpaired
examples from the recipes' toy prompt/completion data (even records desirable with their own
completion, odd ones undesirable with the next record's), the KL term estimated from mismatched
completions in each batch, rows of their own lengths (no `pad_to_multiple_of`), 4 SGD steps and
an evaluation on 8 held-out examples every 2 steps; every logged metric in `trainer_state.json`.

    [accelerate launch --config_file …] tests/scripts/trl_kto.py OUTPUT_DIR PER_DEVICE VARIANT[,VARIANT…] [--moe]

One training per variant, one after the other in this process, each in OUTPUT_DIR/VARIANT: `kto`,
`kto-precompute` (the reference log-probs precomputed over the dataset before training, into a
datasets cache of its own). `--moe`: the tiny Qwen3.5-MoE (`build_tiny_moe_causal_lm` at the recipes'
byte-level vocabulary) as policy and reference.
"""

import sys
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import KTOConfig, KTOTrainer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def tiny_model(moe: bool = False) -> torch.nn.Module:
    set_seed(0)  # policy and reference start from the same weights
    if moe:
        from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

        return build_tiny_moe_causal_lm(seed=0, vocab_size=264, eos_token_id=256, pad_token_id=256)
    config = AutoConfig.from_pretrained(RECIPES / "configs" / "tiny_qwen35.json")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def unpaired_examples(cache_dir: str):
    data = load_dataset("json", data_files=str(RECIPES / "data" / "sft_tiny.jsonl"), split="train", cache_dir=cache_dir)
    completions = data["completion"]
    return data.map(
        lambda record, i: {"prompt": record["prompt"], "label": i % 2 == 0,
                           "completion": record["completion"] if i % 2 == 0 else completions[(i + 1) % len(completions)]},
        with_indices=True, remove_columns=data.column_names,
    )


def main(out: str, per_device: int, precompute: bool, moe: bool = False) -> None:
    tokenizer = AutoTokenizer.from_pretrained(RECIPES / "configs" / "tokenizer")
    # A datasets cache per run: precomputed reference log-probs are cached by fingerprints two runs share.
    examples = unpaired_examples(str(Path(out) / "datasets_cache"))
    args = KTOConfig(
        output_dir=out,
        max_steps=4,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        optim="sgd",
        learning_rate=0.3,
        lr_scheduler_type="constant",
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_drop_last=True,
        bf16=False,  # fp32 makes the comparison exact
        max_length=64,
        pad_to_multiple_of=None,
        precompute_ref_log_probs=precompute,
    )
    trainer = KTOTrainer(model=tiny_model(moe), ref_model=tiny_model(moe), args=args,
                         train_dataset=examples.select(range(8, len(examples))), eval_dataset=examples.select(range(8)),
                         processing_class=tokenizer)
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    for variant in sys.argv[3].split(","):
        main(str(Path(sys.argv[1]) / variant), int(sys.argv[2]), precompute={"kto": False, "kto-precompute": True}[variant],
             moe="--moe" in sys.argv[4:])
