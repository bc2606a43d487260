"""TRL's `DPOTrainer` with an explicit reference model, as a user writes it: the recipes' tiny
Qwen3.5 as policy and as frozen reference (the same initial weights, two objects), preference
pairs built from the recipes' toy prompt/completion data, 4 SGD steps; losses, reward
metrics and grad norms in `trainer_state.json`.

    [accelerate launch --config_file …] tests/scripts/trl_dpo.py OUTPUT_DIR PER_DEVICE [lora]
    [accelerate launch --config_file …] tests/scripts/trl_dpo.py OUTPUT_DIR PER_DEVICE --variants V,V… [--eval] [--moe]

With `lora`: no reference model; TRL trains LoRA adapters and takes the reference
log-probabilities from the policy with its adapters disabled. With `--variants`: one training
per variant, one after the other in this process, each in OUTPUT_DIR/VARIANT: `sigmoid`, `ipo`
(DPO's loss types), `sigmoid-precompute` (the reference log-probs precomputed over the dataset
before training, `precompute_ref_log_probs=True`, into a datasets cache of its own). `--eval`: an
evaluation on 8 held-out pairs every 2 steps. `--moe`: the tiny Qwen3.5-MoE (`build_tiny_moe_causal_lm` at the
recipes' vocabulary, the router's loss on: TRL adds it to DPO's loss).
"""

import sys
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import DPOConfig, DPOTrainer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def tiny_model(moe: bool = False) -> torch.nn.Module:
    set_seed(0)  # policy and reference start from the same weights
    if moe:
        from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

        return build_tiny_moe_causal_lm(seed=0, vocab_size=264, eos_token_id=256, pad_token_id=256, output_router_logits=True)
    config = AutoConfig.from_pretrained(RECIPES / "configs" / "tiny_qwen35.json")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def preference_pairs(cache_dir: str | None = None):
    """prompt, chosen = its completion, rejected = the next record's completion."""
    data = load_dataset("json", data_files=str(RECIPES / "data" / "sft_tiny.jsonl"), split="train", cache_dir=cache_dir)
    completions = data["completion"]
    return data.map(
        lambda record, i: {"prompt": record["prompt"], "chosen": record["completion"],
                           "rejected": completions[(i + 1) % len(completions)]},
        with_indices=True, remove_columns=data.column_names,
    )


def main(out: str, per_device: int, lora: bool = False, loss_type: str = "sigmoid", precompute: bool = False,
         evaluate: bool = False, moe: bool = False) -> None:
    tokenizer = AutoTokenizer.from_pretrained(RECIPES / "configs" / "tokenizer")
    model, ref_model = tiny_model(moe), None if lora else tiny_model(moe)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "in_proj_qkv"])
    # A datasets cache per run: the precomputed reference log-probs are cached by the dataset's and the
    # model's fingerprints, which two runs share (a second run would read the first one's).
    pairs = preference_pairs(str(Path(out) / "datasets_cache") if precompute else None)
    train, held_out = (pairs.select(range(8, len(pairs))), pairs.select(range(8))) if evaluate else (pairs, None)
    args = DPOConfig(
        output_dir=out,
        max_steps=4,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        optim="sgd",
        learning_rate=0.3,
        lr_scheduler_type="constant",
        logging_steps=1,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=2,
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_drop_last=True,
        bf16=False,  # fp32 makes the comparison exact
        max_length=64,
        pad_to_multiple_of=8,
        loss_type=[loss_type],
        precompute_ref_log_probs=precompute,
    )
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=train, eval_dataset=held_out,
                         processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    trainer.save_state()


VARIANTS = {"sigmoid": ("sigmoid", False), "ipo": ("ipo", False), "sigmoid-precompute": ("sigmoid", True)}


if __name__ == "__main__":
    out, per_device, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if "--variants" in rest:
        names = rest[rest.index("--variants") + 1].split(",")
        for name in names:
            loss_type, precompute = VARIANTS[name]
            main(str(Path(out) / name), per_device, lora="lora" in rest, loss_type=loss_type, precompute=precompute,
                 evaluate="--eval" in rest, moe="--moe" in rest)
    else:
        main(out, per_device, lora=rest == ["lora"])
