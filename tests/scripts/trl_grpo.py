"""TRL's `GRPOTrainer` (and `RLOOTrainer`) as a user writes them: the recipes' tiny Qwen3.5 saved
to a folder (policy and reference both load it), the recipes' toy prompts (of different lengths:
TRL pads them on the left), a length reward, 2 SGD steps; losses, rewards, KL, clip ratios and
grad norms in `trainer_state.json`, and every completion each rank trained on in
`completions-rank{R}.json` (prompt, completion token ids, in the order the reward saw them).

    [accelerate launch --config_file …] tests/scripts/trl_grpo.py OUTPUT_DIR PER_DEVICE [--variants V,V…] [--eval] [--eval-per-device N] [--moe]

Without `--variants`: the `dapo` variant in OUTPUT_DIR. Each variant trains in OUTPUT_DIR/VARIANT,
one after the other in this process: `dapo` (TRL's default loss, `beta` 0.1: a reference model),
`grpo` (`num_iterations` 2: old log-probs; gradient accumulation 2; no reference), `dr_grpo`
(`beta` 0.1, gradient accumulation 2, `scale_rewards="batch"`), `rloo` (`RLOOTrainer`, `beta` 0.1).
`dapo_eval`, or `--eval` for every variant: an evaluation on 4 held-out prompts (4 generations each)
after each step (`--eval-per-device`: its per-device batch, PER_DEVICE otherwise).
The model's generation config stops at any of 40 tokens, so some completions end at EOS and
others are clipped at `max_completion_length`. `--moe`: the tiny Qwen3.5-MoE instead (at the recipes'
byte-level vocabulary; TRL adds its router's load-balancing loss).
"""

import json
import os
import sys
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SEEN: list[dict] = []  # what the reward function scored on this rank, in order


def reward_length(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kwargs) -> list[float]:
    SEEN.extend({"prompt": p, "completion_ids": ids} for p, ids in zip(prompts, completion_ids))
    return [len(completion) / 10 for completion in completions]


VARIANTS = {  # trainer, then the config's settings
    "dapo": ("grpo", {"beta": 0.1, "loss_type": "dapo"}),
    "dapo_eval": ("grpo", {"beta": 0.1, "loss_type": "dapo"}),  # and an evaluation after each step
    "grpo": ("grpo", {"beta": 0.0, "loss_type": "grpo", "num_iterations": 2, "gradient_accumulation_steps": 2}),
    "dr_grpo": ("grpo", {"beta": 0.1, "loss_type": "dr_grpo", "gradient_accumulation_steps": 2, "scale_rewards": "batch"}),
    "rloo": ("rloo", {"beta": 0.1}),
}


def save_initial_model(out: str, moe: bool = False) -> Path:
    """The same initial weights on every rank, each saved to its own folder (no rank waits for
    another's) before any trainer starts the process group; with the group already up (an earlier
    run in this process: tests/scripts/several_runs.py) `save_pretrained` writes on rank 0 alone,
    so every rank reads rank 0's folder after a barrier."""
    tokenizer = AutoTokenizer.from_pretrained(RECIPES / "configs" / "tokenizer")
    grouped = torch.distributed.is_initialized()
    model_dir = Path(out) / f"initial-rank{0 if grouped else os.environ.get('RANK', '0')}"
    set_seed(0)
    if moe:
        from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

        model = build_tiny_moe_causal_lm(seed=0, vocab_size=264, eos_token_id=256, pad_token_id=256)
    else:
        config = AutoConfig.from_pretrained(RECIPES / "configs" / "tiny_qwen35.json")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(60, 99)]  # ~15 % per token
    model.save_pretrained(model_dir)
    if grouped:
        torch.distributed.barrier()
    return model_dir


def main(out: str, model_dir: Path, per_device: int, variant: str, evaluate: bool = False,
         eval_per_device: int | None = None) -> None:
    SEEN.clear()
    tokenizer = AutoTokenizer.from_pretrained(RECIPES / "configs" / "tokenizer")
    prompts = load_dataset("json", data_files=str(RECIPES / "data" / "sft_tiny.jsonl"), split="train")
    prompts = prompts.select_columns(["prompt"])
    train, held_out = (prompts.select(range(4, len(prompts))), prompts.select(range(4))) if evaluate else (prompts, None)
    kind, settings = VARIANTS[variant]
    config_class, trainer_class = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    args = config_class(
        output_dir=out,
        max_steps=2,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=eval_per_device or per_device,
        num_generations=4,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=1,
        max_completion_length=8,
        optim="sgd",
        learning_rate=0.1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        bf16=False,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        **settings,
    )
    trainer = trainer_class(model=str(model_dir), reward_funcs=reward_length, args=args,
                            train_dataset=train, eval_dataset=held_out, processing_class=tokenizer)
    trainer.train()
    trainer.save_state()
    (Path(out) / f"completions-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(SEEN))


if __name__ == "__main__":
    out, per_device, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    model_dir = save_initial_model(out, moe="--moe" in rest)
    eval_per_device = int(rest[rest.index("--eval-per-device") + 1]) if "--eval-per-device" in rest else None
    if "--variants" in rest:
        for name in rest[rest.index("--variants") + 1].split(","):
            main(str(Path(out) / name), model_dir, per_device, name, evaluate="--eval" in rest or name.endswith("_eval"),
                 eval_per_device=eval_per_device)
    else:
        main(out, model_dir, per_device, "dapo", evaluate="--eval" in rest, eval_per_device=eval_per_device)
