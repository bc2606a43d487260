"""TRL's `SFTTrainer` as a user writes it: the tiny Qwen3.5 of the recipes on their toy
prompt/completion data, 4 SGD steps, losses in `trainer_state.json`.

    [accelerate launch --config_file …] tests/scripts/trl_sft.py OUTPUT_DIR MODE PER_DEVICE [--packing_hook]

MODE: `padded` (TRL's default collator), `padding_free` (one row per batch, positions
restarting per example) or `packing` (TRL's BFD packing of the data set into rows of 64
tokens). `--packing_hook` (single-process reference runs only) computes packed rows
document by document with qwen35_accel's GatedDeltaNet layers (`install_fp32_gate`,
itself checked against the unmodified model document by document in
tests/test_packing.py); without it a single process leaks across documents, as
unmodified Transformers does.
"""

import sys
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import SFTConfig, SFTTrainer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def main(out: str, mode: str, per_device: int, packing_hook: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(RECIPES / "configs" / "tokenizer")
    set_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(RECIPES / "configs" / "tiny_qwen35.json"), dtype=torch.float32, attn_implementation="sdpa"
    )
    if packing_hook:
        from qwen35_accel.model.fp32_gate import install_fp32_gate

        install_fp32_gate(model)
    args = SFTConfig(
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
        bf16=False,  # SFTConfig's default is bf16; fp32 makes the comparison exact
        padding_free=mode == "padding_free",
        packing=mode == "packing",
        max_length=None if mode == "padding_free" else 64,  # TRL: padding-free without packing takes no max_length
    )
    dataset = load_dataset("json", data_files=str(RECIPES / "data" / "sft_tiny.jsonl"), split="train")
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--packing_hook" in sys.argv[4:])
