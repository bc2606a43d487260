"""TRL's `SFTTrainer` as a user writes it: the tiny Qwen3.5 of the recipes on their toy
prompt/completion data, 4 SGD steps with an evaluation every 2, every metric TRL and the
Trainer log in `trainer_state.json`.

    [accelerate launch --config_file …] tests/scripts/trl_sft.py OUTPUT_DIR MODE PER_DEVICE [--packing_hook] [--lora] [--no_eval]

MODE: `padded` (TRL's default collator), `padding_free` (one row per batch, positions
restarting per example) or `packing` (TRL's BFD packing of the data set into rows of 64
tokens). `--packing_hook` (single-process reference runs only) computes packed rows
document by document with qwen35_accel's GatedDeltaNet layers (`install_fp32_gate`,
itself checked against the unmodified model document by document in
tests/test_packing.py); without it a single process leaks across documents, as
unmodified Transformers does. `--lora`: PEFT LoRA adapters instead of the whole model.
`--no_eval`: training only.

The evaluation set is 8 distinct examples of one shape (21 prompt + 9 completion tokens):
the Trainer's `eval_loss` is the mean of each data-parallel rank's own per-token mean
(stock Transformers), which equals one process's mean over the global batch only when
every rank holds as many label tokens; TRL's eval entropy and accuracy sum counts over
the ranks and need no such care.
"""

import sys
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import SFTConfig, SFTTrainer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def eval_examples(dataset, tokenizer, count: int = 8):
    """The first `count` distinct examples with a 21-token prompt and a 9-token completion."""
    seen: set[str] = set()

    def keep(record) -> bool:
        shape = len(tokenizer(record["prompt"]).input_ids), len(tokenizer(record["completion"]).input_ids)
        if shape != (21, 9) or record["prompt"] in seen:
            return False
        seen.add(record["prompt"])
        return True

    return dataset.filter(keep).select(range(count))


def main(out: str, mode: str, per_device: int, packing_hook: bool, lora: bool, evaluate: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(RECIPES / "configs" / "tokenizer")
    set_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(RECIPES / "configs" / "tiny_qwen35.json"), dtype=torch.float32, attn_implementation="sdpa"
    )
    if packing_hook:
        from qwen35_accel.model.fp32_gate import install_fp32_gate

        install_fp32_gate(model)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "in_proj_qkv"])
    args = SFTConfig(
        output_dir=out,
        max_steps=4,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=2,
        optim="sgd",
        learning_rate=3.0 if lora else 0.3,  # the adapters start at zero (B = 0): a larger step to move the metrics
        lr_scheduler_type="constant",
        logging_steps=1,
        include_num_input_tokens_seen="non_padding",  # the Trainer's own token count, logged and compared too
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_drop_last=True,
        bf16=False,  # SFTConfig's default is bf16; fp32 makes the comparison exact
        padding_free=mode == "padding_free",
        packing=mode == "packing",
        max_length=None if mode == "padding_free" else 64,  # TRL: padding-free without packing takes no max_length
        # Every padded batch 62 positions long (the longest example has 57) on every rank, so the ranks'
        # batch shapes add up to one process's (the Trainer's total_flos counts positions); not a
        # multiple of 2·cp, so the plugin's CP padding still runs.
        pad_to_multiple_of=62 if mode == "padded" else "auto",
    )
    dataset = load_dataset("json", data_files=str(RECIPES / "data" / "sft_tiny.jsonl"), split="train")
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=eval_examples(dataset, tokenizer) if evaluate else None,
                         processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--packing_hook" in sys.argv[4:], "--lora" in sys.argv[4:], "--no_eval" not in sys.argv[4:])
