"""Every rank runs the vision tower every forward, so mixed image/text batches keep FSDP2 matched.

When the vision tower has FSDP2 units of its own (one per vision block: a trainable tower, or
a frozen one under `frozen_multimodal_sharding="shard"`), a rank whose batch holds no images
and no videos would skip the tower while another rank runs it: the ranks' all-gathers (and,
trainable, reduce-scatters, the root unit's included: its patch embedding, position embedding
and merger would have gradients on one rank and none on the other) no longer pair up. gloo
aborts ("Is there a distributed collective mismatch"), NCCL hangs.

`install_vision_placeholder(model)` registers a forward pre-hook on the VLM's inner
`Qwen3_5Model` that makes every forward call the tower exactly once, so every rank runs the
same units the same number of times:
- images or videos: Transformers' call, unchanged;
- images and videos (Transformers calls the tower twice): one call on both, cu_seqlens keeping
  each image and video apart (the same embeddings), passed on as `mm_encoder_outputs`;
- neither: the tower runs on `placeholder_image` (one all-zero image of the smallest grid the
  tower takes: 1 x merge x merge patches, one merged token) and its output, times exactly
  zero, is added to the input embeddings. Autograd then reaches every tower parameter in
  backward (gradient exactly zero on this rank, so the reduce-scatters match and their
  average is the one process's gradient), and the loss is unchanged bit for bit (x + 0 == x).
  A frozen tower's output needs no gradient: forward only, no backward collectives on any
  rank. The input is finite by construction (zeros), so 0 * output is 0, never 0 * inf = NaN.
A caller's own `mm_encoder_outputs` pass through untouched (it ran the tower itself).

A hook on the inner model rather than a subclass or wrapper: the inner model is not an FSDP2
unit (no hook order to respect), the outer class, checkpoint keys and `forward` stay the
Transformers ones, and the kwargs a Trainer/collator passes (`pixel_values`,
`image_grid_thw`, `mm_token_type_ids`, video kwargs) reach the model as before; only
`inputs_embeds` (or `mm_encoder_outputs`) is added, with `input_ids` kept for the placeholder
masks and mRoPE.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe

from ..model.detect import head_backbone, unwrap_qwen35

PLACEHOLDER_HOOK_ATTR = "_qwen35_vision_placeholder_hook"


def vision_tower_has_units(vision_model: nn.Module | None) -> bool:
    """Whether any vision block is its own FSDP2 unit (the tower then needs every rank)."""
    return vision_model is not None and any(isinstance(block, FSDPModule) for block in vision_model.blocks)


def placeholder_image(vision_config: Any, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest image the tower takes, all zeros.

    Returns (`pixel_values` [merge**2, in_channels * temporal_patch_size * patch_size**2]
    fp32 zeros, `grid_thw` [[1, merge, merge]] int64): one temporal patch, a merge x merge
    patch grid, so the merger emits exactly one token.
    """
    merge = vision_config.spatial_merge_size
    patch_dim = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    pixel_values = torch.zeros(merge * merge, patch_dim, device=device)
    grid_thw = torch.tensor([[1, merge, merge]], dtype=torch.long, device=device)
    return pixel_values, grid_thw


def _inner_vlm(model: nn.Module) -> hf.Qwen3_5Model:
    """The VLM's inner model (`Qwen3_5Model`, or the MoE family's `Qwen3_5MoeModel`: the same
    vision tower and multimodal forward; a classification head's backbone)."""
    model = unwrap_qwen35(model)
    model = head_backbone(model) or model
    conditional = (hf.Qwen3_5ForConditionalGeneration, hf_moe.Qwen3_5MoeForConditionalGeneration)
    inner = model.model if isinstance(model, conditional) else model
    if not isinstance(inner, (hf.Qwen3_5Model, hf_moe.Qwen3_5MoeModel)):
        raise TypeError(f"expected a Qwen3_5ForConditionalGeneration or Qwen3_5Model (or the MoE family's); got {type(model).__name__}")
    return inner


def _as_kwargs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name (positional ones included), `**kwargs` flattened."""
    if not args:
        return dict(kwargs)
    bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
    bound.pop("self", None)
    extra = bound.pop("kwargs", {})
    return {**bound, **extra}


def _encode_together(
    module: hf.Qwen3_5Model, images: torch.Tensor, image_grid_thw: torch.Tensor, videos: torch.Tensor, video_grid_thw: torch.Tensor
) -> dict[str, BaseModelOutputWithPooling]:
    """Images and videos in one tower call, as `mm_encoder_outputs` (the tower encodes each
    image and video on its own, cu_seqlens apart: the same embeddings as two calls)."""
    pixel_values = torch.cat([images, videos]).type(module.visual.dtype)
    grid_thw = torch.cat([image_grid_thw, video_grid_thw])
    merged = module.visual(pixel_values, grid_thw=grid_thw).pooler_output
    sizes = (grid_thw.prod(-1) // module.visual.spatial_merge_size**2).tolist()
    embeddings = torch.split(merged, sizes)
    count = len(image_grid_thw)
    return {
        "image": BaseModelOutputWithPooling(pooler_output=embeddings[:count]),
        "video": BaseModelOutputWithPooling(pooler_output=embeddings[count:]),
    }


def _one_tower_call(module: hf.Qwen3_5Model, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    kwargs = _as_kwargs(module, args, kwargs)
    if kwargs.get("mm_encoder_outputs"):
        return None  # encoded by the caller
    images, videos = kwargs.get("pixel_values"), kwargs.get("pixel_values_videos")
    if (images is None) != (videos is None):
        return (), kwargs  # Transformers' one call
    # The embedding before the tower, as in Transformers' forward: the same order of FSDP2 units on every rank.
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        embeds = kwargs["inputs_embeds"] = module.get_input_embeddings()(kwargs["input_ids"])
    if images is not None:
        kwargs["mm_encoder_outputs"] = _encode_together(module, images, kwargs["image_grid_thw"], videos, kwargs["video_grid_thw"])
        kwargs["pixel_values"] = kwargs["pixel_values_videos"] = None
        return (), kwargs
    pixel_values, grid_thw = placeholder_image(module.visual.config, embeds.device)
    output = module.visual(pixel_values.type(module.visual.dtype), grid_thw=grid_thw).pooler_output  # [1, text hidden]
    # Multiply before summing: the sum of a finite output could overflow in half precision.
    kwargs["inputs_embeds"] = embeds + output.mul(0).sum().to(embeds.dtype)
    return (), kwargs


def install_vision_placeholder(model: nn.Module) -> bool:
    """Make every forward of a VLM `model` run its vision tower (see the module docstring).

    `model`: a `Qwen3_5ForConditionalGeneration` or `Qwen3_5Model` (possibly PEFT-wrapped).
    Idempotent; returns True when the hook was installed by this call.
    """
    inner = _inner_vlm(model)
    if getattr(inner, PLACEHOLDER_HOOK_ATTR, None) is not None:
        return False
    setattr(inner, PLACEHOLDER_HOOK_ATTR, inner.register_forward_pre_hook(_one_tower_call, with_kwargs=True))
    return True
