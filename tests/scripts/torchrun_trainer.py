"""The Trainer with FSDP2 (and context parallelism) configured in `TrainingArguments`, the
way many Trainer users set it up, launched by torchrun: no Accelerate config file.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/torchrun_trainer.py OUTPUT_DIR [--no_use_cpu]
    python tests/scripts/torchrun_trainer.py OUTPUT_DIR        # one process: the reference

Under torchrun the script trains twice, one after the other in the same processes, each run
4 SGD steps of the recipe's tiny Qwen3.5 on its toy data (every batch padded to 62 tokens):
`OUTPUT_DIR/fsdp2` with `fsdp="full_shard auto_wrap"`, `fsdp_config={"version": 2, ...}`
(dp 2, 2 rows per rank; the string form Transformers 5 still takes, with a deprecation
warning) and `OUTPUT_DIR/cp2` with `fsdp=True`, the same `fsdp_config` and
`parallelism_config=ParallelismConfig(cp_size=2)` (4 rows, each split over the 2 ranks). The
global batch is 4 rows in both, as in the one-process run (`OUTPUT_DIR/single`). Each output
directory gets `trainer_state.json` and the saved model.

On a machine without accelerators `use_cpu=True` is set (`--no_use_cpu` leaves it out, to
show what stock Transformers says then). `--deepspeed` trains once instead, `OUTPUT_DIR/zero2`:
`TrainingArguments(deepspeed={...ZeRO-2...})`, 2 rows per rank.
"""

import sys
from pathlib import Path

import torch
from accelerate.parallelism_config import ParallelismConfig
from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import sft  # noqa: E402  (the recipe's tokenizer, tiny model and toy data)

ROWS = 4  # the global batch of every run
# `Trainer(deepspeed=...)`'s dict form, values left to the Trainer ("auto") as users write it.
DEEPSPEED = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
FSDP_CONFIG = {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3_5DecoderLayer"], "reshard_after_forward": True}


def train(out: Path, per_device: int, *, fsdp: str | bool, parallelism_config: ParallelismConfig | None, use_cpu: bool,
          deepspeed: dict | None = None) -> None:
    script_args = sft.ScriptArguments(pad_to_multiple_of=62)  # the longest example has 57 tokens
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=per_device,
        optim="sgd",
        learning_rate=0.3,
        lr_scheduler_type="constant",
        logging_steps=1,
        seed=0,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        remove_unused_columns=False,
        disable_tqdm=True,
        use_cpu=use_cpu,
        fsdp=fsdp,
        fsdp_config=dict(FSDP_CONFIG) if fsdp else None,
        parallelism_config=parallelism_config,
        deepspeed=deepspeed,
    )
    tokenizer = sft.load_tokenizer(script_args)
    model = sft.load_model(script_args, args.seed)
    collator = DataCollatorForSeq2Seq(
        tokenizer, padding=True, pad_to_multiple_of=script_args.pad_to_multiple_of, label_pad_token_id=sft.IGNORE_INDEX,
        return_tensors="pt",
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=sft.build_dataset(script_args, args, tokenizer), data_collator=collator,
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(str(out))
    trainer.save_state()


def main(out: str, use_cpu: bool, deepspeed: bool = False) -> None:
    import os

    root = Path(out)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        train(root / "single", ROWS, fsdp=False, parallelism_config=None, use_cpu=use_cpu)
        return
    world = int(os.environ["WORLD_SIZE"])
    if deepspeed:  # DeepSpeed off where use_cpu is set: on CPU the plugin runs it over gloo
        train(root / "zero2", ROWS // world, fsdp=False, parallelism_config=None, use_cpu=False, deepspeed=DEEPSPEED)
        return
    train(root / "fsdp2", ROWS // world, fsdp="full_shard auto_wrap", parallelism_config=None, use_cpu=use_cpu)
    train(root / "cp2", ROWS, fsdp=True, parallelism_config=ParallelismConfig(cp_size=world), use_cpu=use_cpu)


if __name__ == "__main__":
    main(sys.argv[1], use_cpu="--no_use_cpu" not in sys.argv[2:] and not torch.cuda.is_available(), deepspeed="--deepspeed" in sys.argv[2:])
