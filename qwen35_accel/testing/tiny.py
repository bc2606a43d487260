"""Test data for tiny dense Qwen3.5 models: random batches, image batches, packed rows.

The tiny models themselves live in the product (`qwen35_accel.model.tiny`: `plan --model
tiny` and the demo use them) and are re-exported here for tests and benchmarks.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

from ..model.tiny import (
    build_tiny_causal_lm,
    build_tiny_moe_causal_lm,
    build_tiny_next_causal_lm,
    build_tiny_qwen4_exp_causal_lm,
    build_tiny_moe_vlm,
    build_tiny_sequence_classifier,
    build_tiny_token_classifier,
    build_tiny_vlm,
    randomize_for_parity,
    tiny_moe_text_config,
    tiny_moe_vlm_config,
    tiny_text_config,
    tiny_vlm_config,
)

__all__ = [
    "build_tiny_causal_lm",
    "build_tiny_moe_causal_lm",
    "build_tiny_next_causal_lm",
    "build_tiny_qwen4_exp_causal_lm",
    "build_tiny_moe_vlm",
    "build_tiny_sequence_classifier",
    "build_tiny_token_classifier",
    "build_tiny_vlm",
    "concat_vlm_batches",
    "mixed_vlm_batch",
    "packed_documents",
    "placed_vlm_batch",
    "random_batch",
    "random_vlm_batch",
    "randomize_for_parity",
    "tiny_moe_text_config",
    "tiny_moe_vlm_config",
    "tiny_text_config",
    "tiny_vlm_config",
]


def random_batch(batch: int, seq: int, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """`input_ids` and `labels` ([batch, seq], int64; labels = input_ids, every token counted)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def random_vlm_batch(config: Qwen3_5Config, batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """One 16-patch image (4 merged tokens) per row, text around it; prompt masked.

    Keys: `input_ids`, `labels`, `pixel_values` [batch*16, 3*2*4*4], `image_grid_thw`
    [batch, 3], `mm_token_type_ids` (1 on image tokens). Needs `tiny_vlm_config` sizes.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = config.text_config.vocab_size - 4  # the top 4 ids are the vision specials
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    ids[:, 2] = config.vision_start_token_id
    ids[:, 3:7] = config.image_token_id
    ids[:, 7] = config.vision_end_token_id
    labels = ids.clone()
    labels[:, :8] = -100
    v = config.vision_config
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size
    return {
        "input_ids": ids,
        "labels": labels,
        "pixel_values": torch.randn(batch * 16, patch_dim, generator=gen),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * batch),
        "mm_token_type_ids": (ids == config.image_token_id).long(),
    }


def mixed_vlm_batch(config: Qwen3_5Config, media: list[str | None], seq: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows with one 16-patch image (`"image"`), one 16-patch single-frame video (`"video"`)
    or only text (None), a collator's keys for what is present; the first 8 labels of every
    row masked, so every row counts `seq - 8` tokens.

    Keys: `input_ids`, `labels`, `mm_token_type_ids` [rows, seq] (0 text, 1 image, 2 video);
    with images `pixel_values` [images*16, 96], `image_grid_thw` [images, 3]; with videos
    `pixel_values_videos` [videos*16, 96], `video_grid_thw` [videos, 3]. Needs
    `tiny_vlm_config` sizes and `seq` >= 9.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = config.text_config.vocab_size - 4  # the top 4 ids are the vision specials
    ids = torch.randint(1, vocab, (len(media), seq), generator=gen)
    types = torch.zeros_like(ids)
    v = config.vision_config
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size
    pixels: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
    for row, kind in enumerate(media):
        if kind is None:
            continue
        ids[row, 2] = config.vision_start_token_id
        ids[row, 3:7] = config.image_token_id if kind == "image" else config.video_token_id
        ids[row, 7] = config.vision_end_token_id
        types[row, 3:7] = 1 if kind == "image" else 2
        pixels[kind].append(torch.randn(16, patch_dim, generator=gen))
    labels = ids.clone()
    labels[:, :8] = -100
    batch = {"input_ids": ids, "labels": labels, "mm_token_type_ids": types}
    for kind, (pixel_key, grid_key) in {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}.items():
        if pixels[kind]:
            batch[pixel_key] = torch.cat(pixels[kind])
            batch[grid_key] = torch.tensor([[1, 4, 4]] * len(pixels[kind]))
    return batch


def placed_vlm_batch(
    config: Qwen3_5Config, rows: list[list[tuple[str, int, int, int]]], seq: int, seed: int, padding: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """Rows with images/videos of any size where the caller puts them: `rows[r]` lists
    (`"image"` or `"video"`, first token, h, w): one frame of an h x w patch grid (h, w even),
    h*w/4 tokens from the first one on, the vision start and end tokens around them.
    `padding[r]`: right-padded tokens of row r (attention_mask 0). Labels: the tokens, -100
    on each row's first 4 and last 3 (so every row counts `seq - 7`, padding included).

    Keys: `input_ids`, `labels`, `attention_mask`, `mm_token_type_ids` [rows, seq]; with
    images `pixel_values` [patches, 96], `image_grid_thw` [images, 3]; videos alike
    (`pixel_values_videos`, `video_grid_thw`). Needs `tiny_vlm_config` sizes.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = config.text_config.vocab_size - 4  # the top 4 ids are the vision specials
    ids = torch.randint(1, vocab, (len(rows), seq), generator=gen)
    types = torch.zeros_like(ids)
    mask = torch.ones_like(ids)
    v = config.vision_config
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size
    media: dict[str, tuple[list[torch.Tensor], list[list[int]]]] = {"image": ([], []), "video": ([], [])}
    for row, items in enumerate(rows):
        for kind, start, h, w in items:
            tokens = h * w // 4
            ids[row, start - 1] = config.vision_start_token_id
            ids[row, start : start + tokens] = config.image_token_id if kind == "image" else config.video_token_id
            ids[row, start + tokens] = config.vision_end_token_id
            types[row, start : start + tokens] = 1 if kind == "image" else 2
            media[kind][0].append(torch.randn(h * w, patch_dim, generator=gen))
            media[kind][1].append([1, h, w])
        if padding and padding[row]:
            mask[row, seq - padding[row] :] = 0
    labels = ids.clone()
    labels[:, :4] = labels[:, -3:] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, "mm_token_type_ids": types}
    for kind, (pixel_key, grid_key) in {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}.items():
        if media[kind][0]:
            batch[pixel_key] = torch.cat(media[kind][0])
            batch[grid_key] = torch.tensor(media[kind][1])
    return batch


def concat_vlm_batches(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One batch holding the rows (and images, videos) of `batches` in order: the oracle's
    global batch from the ranks' local ones. A key missing from some batches (no images
    there) concatenates over the batches that have it."""
    keys = dict.fromkeys(key for batch in batches for key in batch)
    return {key: torch.cat([batch[key] for batch in batches if key in batch]) for key in keys}


def packed_documents(lengths: list[int], vocab_size: int, seed: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """One packed row of documents of `lengths`, as `DataCollatorWithFlattening` makes it.

    Returns (batch, documents): batch `input_ids` [1, T], `position_ids` [1, T]
    restarting at 0 per document, `labels` [1, T] = input_ids with -100 at each
    document's first token (no prediction across a boundary); documents: each one's ids
    [1, length], the oracle's inputs.
    """
    gen = torch.Generator().manual_seed(seed)
    documents = [torch.randint(1, vocab_size, (1, n), generator=gen) for n in lengths]
    ids = torch.cat(documents, dim=1)
    labels = torch.cat([torch.cat([torch.tensor([[-100]]), d[:, 1:]], dim=1) for d in documents], dim=1)
    positions = torch.cat([torch.arange(n)[None] for n in lengths], dim=1)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}, documents
