"""TRL's `SFTTrainer` on the tiny Qwen3.5 VLM (`Qwen3_5ForConditionalGeneration`) as a user
writes it: a processor (built here, no downloads), rows of `prompt` + `completion` + `images`
(PIL images of several sizes in the prompt, some rows without one; the prompt masked from the
loss), TRL's own vision-language collator, SFTConfig's defaults
(Transformers' gradient checkpointing), fp32, SGD, 4 steps; rank 0 writes trainer_state.json.

    [accelerate launch --config_file …] tests/scripts/trl_sft_vlm.py OUTPUT_DIR PER_DEVICE [--text_only]

`--text_only`: the same rows without images through the same VLM class, the tokenizer as the
processing class (TRL's text collator). `--moe`: the MoE VLM class (`Qwen3_5MoeForConditionalGeneration`,
`tiny_moe_vlm_config`; TRL turns the router's loss on).

The processor: the recipes' byte-level tokenizer with Qwen's vision tokens added, Transformers'
PIL image processor (4-pixel patches, merge 2: the tiny tower's sizes) and `Qwen3VLProcessor`
without its video processor (which needs torchvision, not importable beside the CPU build of
torch). The model's vision token ids are the tokenizer's.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from PIL import Image
from transformers import AutoTokenizer, set_seed
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from trl import SFTConfig, SFTTrainer

from qwen35_accel.testing.tiny import randomize_for_parity, tiny_moe_vlm_config, tiny_vlm_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# (height, width) in pixels: patch grids 1×4×4 to 1×8×10 (multiples of 8: merge 2 of 4-pixel patches).
SIZES = [(16, 16), (16, 24), (24, 16), (32, 24), (24, 32), (32, 40), (16, 32), (40, 24)]


class ImageOnlyProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without a video processor (images only)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def build(text_only: bool, moe: bool = False):
    tokenizer = AutoTokenizer.from_pretrained(RECIPES / "configs" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    config = (tiny_moe_vlm_config if moe else tiny_vlm_config)(
        vocab_size=264, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    config.vision_start_token_id, config.vision_end_token_id = start, end
    config.image_token_id, config.video_token_id = image, video
    torch.manual_seed(0)
    model_class = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    model = randomize_for_parity(model_class(config), seed=0)
    if text_only:
        return model, tokenizer
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=40 * 40)
    return model, ImageOnlyProcessor(images, tokenizer)


def rows(text_only: bool, count: int = 16) -> Dataset:
    """`count` rows with one image each in the prompt (every fourth row none), completions of 4-9 words."""
    rng = np.random.RandomState(0)
    words = ["red", "square", "cat", "sun", "blue", "tree", "a", "the", "over", "small", "bright", "river"]
    prompts, completions, images = [], [], []
    for i in range(count):
        has_image = not text_only and i % 4 != 3
        prompts.append(f"{i} look: <|vision_start|><|image_pad|><|vision_end|> what?" if has_image else f"{i} look: what?")
        completions.append(" " + " ".join(rng.choice(words, size=rng.randint(4, 10))))
        h, w = SIZES[i % len(SIZES)]
        images.append([Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8))] if has_image else [])
    columns = {"prompt": prompts, "completion": completions}
    return Dataset.from_dict(columns if text_only else {**columns, "images": images})


def main(out: str, per_device: int, text_only: bool, moe: bool = False) -> None:
    set_seed(0)
    model, processing_class = build(text_only, moe)
    args = SFTConfig(
        output_dir=out, max_steps=4, per_device_train_batch_size=per_device, optim="sgd", learning_rate=0.3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", seed=0,
        dataloader_drop_last=True, bf16=False, max_length=None, disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows(text_only), processing_class=processing_class)
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--text_only" in sys.argv[3:], "--moe" in sys.argv[3:])
