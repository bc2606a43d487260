"""Images and videos under context parallelism: the vision tower's work split over the cp ranks.

Under CP every rank holds two chunks of each row (`layout.py`), but an image's tokens may
fall in any chunk (or straddle two), and Qwen3.5's multimodal RoPE positions depend on the
whole row. A forward pre-hook on the VLM's inner `Qwen3_5Model`
(`install_context_parallel_vision`), for a call carrying `pixel_values` and/or
`pixel_values_videos` (whole, the same on every cp rank, with `image_grid_thw` /
`video_grid_thw`):

1. all-gathers the local `input_ids` and padding mask over the cp group (one small integer
   collective), so every rank sees the whole rows;
2. embeds the local tokens (before the tower, as Transformers' forward does: the same order
   of FSDP2 units as a rank without images);
3. encodes this rank's share of the images and videos in one tower call: the items are
   dealt largest first to the least-loaded rank by patch count (`vision_shares`, the same on
   every rank from the grids alone); a rank with no share runs the tower on the zero
   placeholder image and keeps none of its output (exactly zero contribution; every rank
   still calls the tower once, so FSDP2 units stay matched);
4. all-gathers the merged embeddings over the cp group (padded to the largest share, sizes
   known from the grids: no size exchange) with `all_gather_with_grad`, whose backward sums
   the gradient over the cp group and keeps this rank's slot: each rank's tower gradient
   comes from its own images, the group's total is one process's (times cp, as the
   decoder's gradients under CP, for FSDP2's average over `dp_shard_cp`);
5. passes Transformers the embedding rows of this rank's image/video tokens as
   `mm_encoder_outputs` (the k-th image token of the whole rows in row-major order takes
   the k-th image embedding, as Transformers' `masked_scatter` does without CP), so its
   own placeholder check and scatter run on the local tokens;
6. with 2-D `position_ids` (the global text positions `shard_batch` and the Trainer add),
   computes the 3-row mRoPE ids with Transformers' `get_rope_index` on the whole rows (and
   the whole padding mask) and passes this rank's part: what the model computes without CP
   when given no `position_ids`. 3- or 4-row `position_ids` are used as given.

`mm_token_type_ids` (read for mRoPE) must be the whole rows ([batch, seq], padded like the
sequence): the Trainer leaves it unsharded and `shard_batch` passes it through.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..collectives import all_gather_flat, all_gather_with_grad
from ..vision_placeholder import _as_kwargs, _inner_vlm, placeholder_image
from .chunks import local_positions, shard_sequence, unshard_sequence

CP_VISION_HOOK_ATTR = "_qwen35_cp_vision_hook"


def vision_shares(patches: list[int], cp: int) -> list[list[int]]:
    """Which items (indices into `patches`, each item's patch count) each of `cp` ranks
    encodes: largest first to the least-loaded rank (ties: lower index, lower rank), each
    rank's items in index order. Deterministic: every rank computes the same shares."""
    loads = [0] * cp
    shares: list[list[int]] = [[] for _ in range(cp)]
    for item in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        rank = min(range(cp), key=lambda r: (loads[r], r))
        shares[rank].append(item)
        loads[rank] += patches[item]
    return [sorted(share) for share in shares]


def _whole_rows(local: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[k, batch, local_seq] integers on each rank -> [k, batch, seq] whole rows."""
    local = local.contiguous()
    gathered = torch.empty((cp * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    all_gather_flat(gathered, local, group=group)
    return unshard_sequence(list(gathered.view(cp, *local.shape).unbind(0)), cp, seq_dim=2)


def _local_padding(attention_mask: Any, like: torch.Tensor) -> torch.Tensor:
    """This rank's [batch, local_seq] padding mask: under CP `_check_inputs` has turned it into
    the layers' dict (None there: no padding in this rank's chunks)."""
    if isinstance(attention_mask, dict):
        attention_mask = attention_mask.get("linear_attention")
    return torch.ones_like(like) if attention_mask is None else attention_mask.to(like.dtype)


def _encode_shares(
    module: nn.Module, pixels: list[torch.Tensor], grids: torch.Tensor, cp: int, rank: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """The merged embeddings of every item ([sum of merged tokens, text hidden], item order),
    this rank encoding its share (`vision_shares`) and the rest all-gathered."""
    visual = module.visual
    merged = (grids.prod(-1) // visual.spatial_merge_size**2).tolist()
    shares = vision_shares(grids.prod(-1).tolist(), cp)
    mine = shares[rank]
    if mine:
        output = visual(torch.cat([pixels[i] for i in mine]).type(visual.dtype), grid_thw=grids[mine]).pooler_output
    else:
        pixel_values, grid_thw = placeholder_image(visual.config, grids.device)
        output = visual(pixel_values.type(visual.dtype), grid_thw=grid_thw).pooler_output[:0]  # none of it kept
    longest = max(sum(merged[i] for i in share) for share in shares)
    padded = torch.cat([output, output.new_zeros(longest - output.shape[0], output.shape[1])])
    gathered = all_gather_with_grad(padded, group).flatten(0, 1)  # [cp * longest, hidden], rank slots
    where: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * len(merged)
    for owner, share in enumerate(shares):
        start = owner * longest
        for item in share:
            where[item] = torch.arange(start, start + merged[item])
            start += merged[item]
    return gathered.index_select(0, torch.cat(where).to(gathered.device))


def _local_rows(embeddings: torch.Tensor, whole_ids: torch.Tensor, token_id: int, cp: int, rank: int, what: str) -> torch.Tensor:
    """The rows of `embeddings` for this rank's `token_id` tokens, in local row-major order
    (Transformers' `masked_scatter` order): the k-th such token of the whole rows takes row k."""
    mask = whole_ids == token_id
    if int(mask.sum()) != embeddings.shape[0]:
        raise ValueError(
            f"{what} features and {what} tokens do not match: the batch's rows hold {int(mask.sum())} {what} tokens, "
            f"its grids give {embeddings.shape[0]} features"
        )
    index = mask.flatten().long().cumsum(0).view_as(mask) - 1
    local = local_positions(whole_ids.shape[1], cp, rank, whole_ids.device)
    return embeddings.index_select(0, index[:, local][mask[:, local]])


def _encode_under_cp(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, group: dist.ProcessGroup
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    kwargs = _as_kwargs(module, args, kwargs)
    images, videos = kwargs.get("pixel_values"), kwargs.get("pixel_values_videos")
    if kwargs.get("mm_encoder_outputs"):
        raise NotImplementedError(
            "mm_encoder_outputs is not supported under context parallelism (they would be placed into this rank's "
            "chunks of the sequence); pass pixel_values / pixel_values_videos with their grids instead."
        )
    if images is None and videos is None:
        return None  # text only: Transformers' forward (and the placeholder hook, if any)
    input_ids = kwargs.get("input_ids")
    if input_ids is None:
        raise NotImplementedError("images or videos under context parallelism need `input_ids` (not `inputs_embeds`)")
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, seq = input_ids.shape[0], input_ids.shape[1] * cp
    image_grid_thw, video_grid_thw = kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw")
    for given, grid, key in ((images, image_grid_thw, "image_grid_thw"), (videos, video_grid_thw, "video_grid_thw")):
        if given is not None and grid is None:
            raise ValueError(f"under context parallelism pass `{key}` with the pixel values it describes")
    position_ids = kwargs.get("position_ids")
    compute_mrope = position_ids is None or position_ids.dim() == 2
    types = kwargs.get("mm_token_type_ids")
    if compute_mrope and (types is None or tuple(types.shape) != (rows, seq)):
        raise ValueError(
            f"under context parallelism with images or videos pass the whole rows' `mm_token_type_ids` [{rows}, {seq}] "
            f"(unsharded, padded like the sequence; the model computes the multimodal RoPE positions from them); got "
            f"{None if types is None else tuple(types.shape)}. qwen35_accel.context_parallel.shard_batch and the "
            "Trainer leave it whole."
        )
    config = module.config
    whole = _whole_rows(torch.stack([input_ids, _local_padding(kwargs.get("attention_mask"), input_ids)]), cp, group)
    whole_ids, whole_mask = whole[0], whole[1]
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:  # before the tower, as Transformers' forward
        kwargs["inputs_embeds"] = module.get_input_embeddings()(input_ids)
    pixels, grids = [], []
    for values, grid in ((images, image_grid_thw), (videos, video_grid_thw)):
        if values is not None:
            pixels.extend(values.split((grid.prod(-1)).tolist()))
            grids.append(grid)
    embeddings = _encode_shares(module, pixels, torch.cat(grids), cp, rank, group)
    count = 0 if images is None else int((image_grid_thw.prod(-1) // module.visual.spatial_merge_size**2).sum())
    outputs = {}
    if images is not None:
        rows_here = _local_rows(embeddings[:count], whole_ids, config.image_token_id, cp, rank, "image")
        outputs["image"] = BaseModelOutputWithPooling(pooler_output=(rows_here,))
    if videos is not None:
        rows_here = _local_rows(embeddings[count:], whole_ids, config.video_token_id, cp, rank, "video")
        outputs["video"] = BaseModelOutputWithPooling(pooler_output=(rows_here,))
    kwargs["mm_encoder_outputs"] = outputs
    kwargs["pixel_values"] = kwargs["pixel_values_videos"] = None
    if compute_mrope:
        padded = None if bool(whole_mask.bool().all()) else whole_mask
        mrope, _ = module.get_rope_index(
            whole_ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            attention_mask=padded,
        )
        kwargs["position_ids"] = shard_sequence(mrope, cp, rank, seq_dim=2)
    return (), kwargs


def install_context_parallel_vision(model: nn.Module, group: dist.ProcessGroup) -> bool:
    """Split a VLM's image/video encoding over the cp `group` (see the module docstring).

    `model`: a `Qwen3_5ForConditionalGeneration` or `Qwen3_5Model` (possibly PEFT-wrapped).
    The hook runs before the mixed-batch placeholder hook (`parallel/vision_placeholder.py`), which then
    stands aside for calls it has encoded. Idempotent; returns True when installed by this call.
    """
    inner = _inner_vlm(model)
    if getattr(inner, CP_VISION_HOOK_ATTR, None) is not None:
        return False
    hook = inner.register_forward_pre_hook(functools.partial(_encode_under_cp, group=group), with_kwargs=True, prepend=True)
    setattr(inner, CP_VISION_HOOK_ATTR, hook)
    return True
