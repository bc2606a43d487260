"""Supervised fine-tuning of a (dense) Qwen3.5 causal LM with the plain Transformers Trainer.

A stock user script: it knows nothing about how it is parallelized. Run it directly for one
process, or under ``accelerate launch --config_file accelerate_configs/<config>.yaml`` for
FSDP2 / context / tensor parallelism.

With no arguments it trains a tiny random-init Qwen3.5 (``recipes/configs/tiny_qwen35.json``)
on the bundled toy data set (``recipes/data/sft_tiny.jsonl``) for 30 steps, which runs on a
CPU in seconds:

    python recipes/sft.py
    python recipes/sft.py --model_name_or_path <path or hub id> --dataset_name <path or hub id>

Data records need ``prompt`` and ``completion`` text fields; the loss is taken on the
completion (and the eos after it) only.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch

try:
    from datasets import load_dataset
except ImportError:  # a plain `pip install .` (no `recipes` extra): the bundled data set still loads, as a list
    load_dataset = None

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    HfArgumentParser,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    set_seed,
)

RECIPES_DIR = Path(__file__).resolve().parent
TINY_CONFIG = RECIPES_DIR / "configs" / "tiny_qwen35.json"
TINY_TOKENIZER = RECIPES_DIR / "configs" / "tokenizer"
TINY_DATA = RECIPES_DIR / "data" / "sft_tiny.jsonl"
TINY_ALIAS = "tiny"
IGNORE_INDEX = -100

# Recipe defaults for TrainingArguments; anything given on the command line wins.
TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/sft",
    "max_steps": 30,
    "per_device_train_batch_size": 4,
    "learning_rate": 3e-3,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
    "dataloader_drop_last": True,
    # Our columns are exactly what the model takes; skip the forward-signature inspection,
    # which would look at a wrapper's signature if the model gets wrapped.
    "remove_unused_columns": False,
    "disable_tqdm": False,
}


@dataclass
class ScriptArguments:
    """Model, tokenizer and data options of this recipe."""

    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": f"Local path or hub id. Unset or '{TINY_ALIAS}': a tiny random-init Qwen3.5 "
                  f"built from {TINY_CONFIG.relative_to(RECIPES_DIR.parent)}."},
    )
    tokenizer_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "Defaults to --model_name_or_path, or to the bundled byte-level tokenizer "
                  "for the tiny model."},
    )
    dataset_name: Optional[str] = field(
        default=None,
        metadata={"help": "Hub id or local path for datasets.load_dataset; unset: the bundled toy data set. "
                  "Records need 'prompt' and 'completion' fields."},
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of --dataset_name to train on."})
    max_seq_length: int = field(default=64, metadata={"help": "Truncate prompt + completion + eos to this."})
    pad_to_multiple_of: int = field(
        default=8,
        metadata={"help": "Pad every batch's length to a multiple of this; 0 disables (under qwen35_accel's "
                  "context parallelism the Trainer pads each batch to a multiple of 2 * cp_size itself)."},
    )
    attn_implementation: str = field(default="sdpa", metadata={"help": "Attention kernel for the model."})
    dtype: Literal["float32", "bfloat16"] = field(
        default="float32", metadata={"help": "dtype the model is created or loaded in."}
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Pack each batch's examples into one row without padding (DataCollatorWithFlattening: "
                  "position_ids restart per example); every example is still computed on its own."},
    )
    packing_flash_attn_kwargs: bool = field(
        default=False,
        metadata={"help": "With --packing, also pass cu_seq_lens_q/k and max_length_q/k (the flash-attention form)."},
    )
    lora: bool = field(
        default=False,
        metadata={"help": "Train LoRA adapters (PEFT) on every linear layer but the lm_head instead of the whole "
                  "model; save_model then writes a PEFT adapter directory."},
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank (with --lora)."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (with --lora)."})
    lora_target_modules: str = field(
        default="all-linear", metadata={"help": "PEFT target_modules: 'all-linear' or comma-separated module names."}
    )


def parse_args(argv: Optional[list[str]] = None) -> tuple[ScriptArguments, TrainingArguments]:
    """Parse script and training arguments, with this recipe's TrainingArguments defaults."""
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    # set_defaults changes the argparse defaults (also what --help shows), so explicit flags still win.
    parser.set_defaults(**TRAINING_DEFAULTS)
    script_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    return script_args, training_args


def is_tiny(script_args: ScriptArguments) -> bool:
    return script_args.model_name_or_path in (None, TINY_ALIAS)


def load_tokenizer(script_args: ScriptArguments) -> PreTrainedTokenizerBase:
    """The tokenizer, right-padded and with a pad token."""
    name = script_args.tokenizer_name_or_path
    if name is None:
        name = str(TINY_TOKENIZER) if is_tiny(script_args) else script_args.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(name)
    tokenizer.padding_side = "right"
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name!r} has no eos token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(script_args: ScriptArguments, seed: int) -> PreTrainedModel:
    """The model: pretrained weights, or the tiny config initialized identically on every process."""
    dtype = getattr(torch, script_args.dtype)
    if is_tiny(script_args):
        config = AutoConfig.from_pretrained(str(TINY_CONFIG))
        set_seed(seed)  # same random init on every process
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=script_args.attn_implementation
        )
    return AutoModelForCausalLM.from_pretrained(
        script_args.model_name_or_path, dtype=dtype, attn_implementation=script_args.attn_implementation
    )


def add_lora(model: PreTrainedModel, script_args: ScriptArguments) -> PreTrainedModel:
    """Wrap `model` with LoRA adapters (PEFT): base weights frozen, adapters trainable (fp32)."""
    from peft import LoraConfig, get_peft_model

    targets = script_args.lora_target_modules
    config = LoraConfig(
        r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        lora_dropout=0.0,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def tokenize_example(
    example: dict[str, str], tokenizer: PreTrainedTokenizerBase, max_seq_length: int
) -> dict[str, list[int]]:
    """prompt + completion + eos; labels are the input ids with the prompt masked out."""
    prompt_ids = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(example["completion"], add_special_tokens=False)["input_ids"]
    completion_ids = completion_ids + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + completion_ids)[:max_seq_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + completion_ids)[:max_seq_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def build_dataset(
    script_args: ScriptArguments, training_args: TrainingArguments, tokenizer: PreTrainedTokenizerBase
) -> Any:
    """Load and tokenize the training split: a `datasets.Dataset`, or without `datasets` installed
    (the bundled data set only) a list of the same tokenized examples."""
    if load_dataset is None:
        if script_args.dataset_name is not None:
            raise ImportError(f"--dataset_name {script_args.dataset_name} needs the datasets package: pip install datasets "
                              "(or this project's recipes extra)")
        rows = [json.loads(line) for line in TINY_DATA.read_text().splitlines() if line.strip()]
        examples = [tokenize_example(row, tokenizer, script_args.max_seq_length) for row in rows]
        return [ex for ex in examples if any(label != IGNORE_INDEX for label in ex["labels"])]
    if script_args.dataset_name is None:
        raw = load_dataset("json", data_files=str(TINY_DATA), split="train")
    else:
        raw = load_dataset(script_args.dataset_name, split=script_args.dataset_split)
    missing = {"prompt", "completion"} - set(raw.column_names)
    if missing:
        raise ValueError(f"dataset lacks the field(s) {sorted(missing)}; it has {raw.column_names}")

    with training_args.main_process_first(desc="tokenizing the data set"):
        dataset = raw.map(
            tokenize_example,
            fn_kwargs={"tokenizer": tokenizer, "max_seq_length": script_args.max_seq_length},
            remove_columns=raw.column_names,
            desc="tokenizing",
        )
        # A prompt that fills max_seq_length leaves nothing to learn from.
        dataset = dataset.filter(
            lambda ex: any(label != IGNORE_INDEX for label in ex["labels"]), desc="dropping prompt-only rows"
        )
    return dataset


def main(argv: Optional[list[str]] = None) -> None:
    script_args, training_args = parse_args(argv)

    tokenizer = load_tokenizer(script_args)
    model = load_model(script_args, training_args.seed)
    if len(tokenizer) > model.config.get_text_config().vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{model.config.get_text_config().vocab_size}"
        )

    if script_args.lora:
        model = add_lora(model, script_args)
    train_dataset = build_dataset(script_args, training_args, tokenizer)
    if script_args.packing:
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=script_args.packing_flash_attn_kwargs)
    else:
        collator = DataCollatorForSeq2Seq(
            tokenizer,
            padding=True,
            pad_to_multiple_of=script_args.pad_to_multiple_of or None,
            label_pad_token_id=IGNORE_INDEX,
            return_tensors="pt",
        )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=collator,
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: the per-step log history
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(training_args.output_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
