"""A Trainer script as users write it for Transformers' own sharding at load, under torchrun:

    python -m torch.distributed.run --nproc_per_node N tests/scripts/distributed_config_trainer.py PATH DTYPE OUT \
        [--replicate R] [--tp T] [--mixed_precision]
    python tests/scripts/distributed_config_trainer.py PATH DTYPE OUT        # one process: the reference

Under torchrun the model loads with `from_pretrained(PATH, dtype=DTYPE, distributed_config=
DistributedConfig(fsdp_size=N // (R * T), dp_replicate_size=R, tp_size=T, fsdp_mixed_precision=...))`; in one process
without `distributed_config`. DTYPE is a torch dtype name or "auto". Then 4 SGD steps of the recipe's
tiny Qwen3.5 toy data (global batch 4 rows, each padded to 62 tokens) with an unchanged `Trainer`;
OUT gets the saved model, `trainer_state.json` and, from rank 0, `gates_at_load.pt` (every
`A_log`/`dt_bias` as the loaded model holds it, whole tensors, before training).
"""

import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import sft  # noqa: E402  (the recipe's tokenizer and toy data)

ROWS = 4


def _option(name: str, default: str | None = None) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main(path: str, dtype: str, out: Path) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kwargs = {}
    if world > 1:
        replicate, tp = int(_option("--replicate", "1")), int(_option("--tp", "1"))
        kwargs["distributed_config"] = DistributedConfig(
            fsdp_size=world // (replicate * tp), dp_replicate_size=replicate, tp_size=tp,
            fsdp_mixed_precision="--mixed_precision" in sys.argv,
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype == "auto" else getattr(torch, dtype), **kwargs)
    gates = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
        for k, v in model.state_dict().items() if k.endswith((".A_log", ".dt_bias"))
    }
    if int(os.environ.get("RANK", "0")) == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(gates, out / "gates_at_load.pt")

    script_args = sft.ScriptArguments(pad_to_multiple_of=62)  # the longest example has 57 tokens
    args = TrainingArguments(
        output_dir=str(out), max_steps=4, per_device_train_batch_size=ROWS // world, optim="sgd", learning_rate=0.3,
        lr_scheduler_type="constant", logging_steps=1, seed=0, save_strategy="no", report_to="none",
        dataloader_drop_last=True, remove_unused_columns=False, disable_tqdm=True, use_cpu=True,
    )
    tokenizer = sft.load_tokenizer(script_args)
    collator = DataCollatorForSeq2Seq(
        tokenizer, padding=True, pad_to_multiple_of=62, label_pad_token_id=sft.IGNORE_INDEX, return_tensors="pt"
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=sft.build_dataset(script_args, args, tokenizer), data_collator=collator,
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(str(out))
    trainer.save_state()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
