"""TRL's `DPOTrainer` and `GRPOTrainer` on the tiny Qwen3.5 VLM with images, as a user writes them:
the processor and image rows of tests/scripts/trl_sft_vlm.py (a quarter of the rows without an
image), DPO on `prompt`/`chosen`/`rejected` + `images` (no reference model: TRL copies the policy),
GRPO on `prompt` + `images` with a length reward; fp32, SGD, 2 steps; rank 0 writes trainer_state.json.

    [accelerate launch --config_file …] tests/scripts/trl_vlm_images.py OUTPUT_DIR {dpo,grpo} [--text_only]

`--text_only`: the same rows without images through the same VLM class, the tokenizer as the
processing class (plain-text prompts for GRPO).
"""

import sys
from pathlib import Path

from datasets import Dataset
from transformers import set_seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_sft_vlm import build, rows  # noqa: E402  (the same processor, model and image rows)


# Qwen-VL's rendering of images in a user turn, and the assistant turn to generate.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def reward_length(completions: list, **kwargs) -> list[float]:
    return [len(str(completion)) / 10 for completion in completions]


def main(out: str, trainer_kind: str, text_only: bool) -> None:
    set_seed(0)
    model, processor = build(text_only)
    data = rows(text_only, count=8)
    if text_only:
        data = data.add_column("images", [[] for _ in range(len(data))])
    common = dict(
        output_dir=out, max_steps=2, per_device_train_batch_size=2, optim="sgd", learning_rate=0.1,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", seed=0, bf16=False,
        disable_tqdm=True,
    )
    if trainer_kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        pairs = Dataset.from_dict({
            "prompt": data["prompt"], "chosen": data["completion"], "rejected": [c[::-1] for c in data["completion"]],
            **({} if text_only else {"images": data["images"]}),
        })
        reference, _ = build(text_only)  # the same initial weights
        trainer = DPOTrainer(model=model, ref_model=reference, args=DPOConfig(**common, max_length=None),
                             train_dataset=pairs, processing_class=processor)
    else:
        from trl import GRPOConfig, GRPOTrainer

        if text_only:
            prompts = Dataset.from_dict({"prompt": data["prompt"]})
        else:  # GRPO takes multimodal prompts as conversations: the processor gets a chat template.
            processor.chat_template = CHAT_TEMPLATE
            conversations = [
                [{"role": "user", "content": [*([{"type": "image"}] if images else []), {"type": "text", "text": f"{i} what?"}]}]
                for i, images in enumerate(data["images"])
            ]
            prompts = Dataset.from_dict({"prompt": conversations, "images": data["images"]})
        config = GRPOConfig(**common, num_generations=2, max_completion_length=8, beta=0.0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_length, args=config, train_dataset=prompts,
                              processing_class=processor)
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--text_only" in sys.argv[3:])
