"""The vision tower of a Qwen3.5 VLM (`Qwen3_5ForConditionalGeneration`): its shape, how a
step uses it, and its share of the memory per rank."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .shapes import OPTIMIZER_STATES, Device, MemoryEstimate, Parallel, StepOptions

VISION_FROZEN_SHARDINGS = ("root", "replicate", "shard")  # QWEN35_ACCEL_FROZEN_MULTIMODAL_SHARDING


@dataclass(frozen=True)
class VisionShape:
    """The sizes of a Qwen3.5 vision tower (`Qwen3_5VisionModel`) that memory depends on."""

    hidden: int
    intermediate: int
    depth: int
    heads: int
    in_channels: int
    patch: int
    temporal_patch: int
    merge: int  # spatial_merge_size: merge x merge patches make one token of the text sequence
    out_hidden: int
    position_embeddings: int

    @classmethod
    def from_config(cls, config: Any) -> VisionShape | None:
        """From a Transformers Qwen3.5 config; None for a text config (no `vision_config`)."""
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        return cls(
            hidden=vision.hidden_size,
            intermediate=vision.intermediate_size,
            depth=vision.depth,
            heads=vision.num_heads,
            in_channels=vision.in_channels,
            patch=int(vision.patch_size),
            temporal_patch=int(vision.temporal_patch_size),
            merge=vision.spatial_merge_size,
            out_hidden=vision.out_hidden_size,
            position_embeddings=vision.num_position_embeddings,
        )

    @property
    def patch_dim(self) -> int:
        """Values per patch (a row of `pixel_values`)."""
        return self.in_channels * self.temporal_patch * self.patch**2

    def block_parameters(self) -> list[tuple[int, ...]]:
        """Shapes of one vision block's parameters: two LayerNorms, qkv and proj, the MLP."""
        h, i = self.hidden, self.intermediate
        return [(h,)] * 4 + [(3 * h, h), (3 * h,), (h, h), (h,), (i, h), (i,), (h, i), (h,)]

    def outer_parameters(self) -> list[tuple[int, ...]]:
        """Shapes of the parameters outside the blocks: patch embedding (a Conv3d), position
        embedding, merger (LayerNorm, two Linears on merge² patches)."""
        h, merged = self.hidden, self.hidden * self.merge**2
        return [
            (h, self.in_channels, self.temporal_patch, self.patch, self.patch), (h,), (self.position_embeddings, h),
            (h,), (h,), (merged, merged), (merged,), (self.out_hidden, merged), (self.out_hidden,),
        ]

    def parameters(self) -> int:
        """All parameters of the tower."""
        return self.depth * _elements(self.block_parameters()) + _elements(self.outer_parameters())


@dataclass(frozen=True)
class VisionTower:
    """A VLM's vision tower as a training step uses it.

    `trainable`: whether it trains (else frozen: no gradients, no optimizer state, no
    activations); `frozen_sharding`: a frozen tower's `frozen_multimodal_sharding`;
    `image_tokens`: image and video tokens in a rank's micro-batch (whole sequences, before
    CP; the tower encodes merge² patches per token), 0 for a text-only step; `storage_bytes`:
    a frozen tower's storage dtype size (Accelerate upcasts only trainable parameters to fp32
    under a bf16/fp16 policy; a trainable tower uses `StepOptions.param_bytes`).
    """

    shape: VisionShape
    trainable: bool = True
    frozen_sharding: str = "root"
    image_tokens: int = 0
    storage_bytes: int = 4

    def __post_init__(self) -> None:
        if self.frozen_sharding not in VISION_FROZEN_SHARDINGS:
            raise ValueError(
                f"frozen_sharding {self.frozen_sharding!r} is not one of {', '.join(VISION_FROZEN_SHARDINGS)}; pass one of them"
            )
        if self.image_tokens < 0:
            raise ValueError(f"image_tokens {self.image_tokens} is negative; pass 0 (a text-only step) or more")

    @property
    def layout(self) -> str:
        """How FSDP2 holds the tower (`PARALLELIZER.apply`): "units" (one unit per block, the
        rest in the root unit: a trainable tower, or frozen under "shard"), "root" (every
        parameter in the root unit) or "replicate" (not sharded: whole on every rank)."""
        return "units" if self.trainable or self.frozen_sharding == "shard" else self.frozen_sharding

    def patches_per_rank(self, parallel: Parallel) -> int:
        """Patches the tower encodes on a rank per micro-step: the image tokens' merge² patches
        each, split over the cp ranks; a text-only step of a tower with units runs the
        placeholder image (one token) instead."""
        tokens = self.image_tokens or (1 if self.layout == "units" else 0)
        return -(-tokens * self.shape.merge**2 // parallel.cp)


def _elements(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def _shard_elements(shapes: list[tuple[int, ...]], shards: int) -> int:
    """Elements on the most loaded rank (rank 0) when FSDP2 splits each tensor's dim 0 in `shards`."""
    return sum(-(-s[0] // shards) * math.prod(s[1:]) for s in shapes)


def _vision_block(shape: VisionShape, compute_bytes: int, device: Device, cast_block_inputs: bool) -> int:
    """Bytes one vision block keeps for backward per patch, not checkpointed (`vision_activations`)."""
    h, i, c = shape.hidden, shape.intermediate, compute_bytes
    stats = 4 if device == "cuda" else c
    rotary = 2 * (h // shape.heads) * 4  # cos and sin, fp32
    return 11 * h * c + 2 * i * c + 4 * stats + 4 * shape.heads + (rotary if cast_block_inputs else 0)


def vision_activations(
    shape: VisionShape, patches: int, compute_bytes: int, device: Device = "cuda", *, cast_block_inputs: bool = False,
    checkpointed: bool = False,
) -> int:
    """Bytes a trainable tower keeps for backward for `patches` patches (sdpa attention per image).

    Per block: the LayerNorms' inputs and mean/rstd (fp32 on CUDA, the input dtype on CPU),
    qkv's input and output (the value is a view of it), the rotated query and key, the
    attention output and fp32 log-sum-exp, proj's input, the MLP's input, fc1's output and
    the activation's output. Once: the patches cast to the compute dtype (the Conv3d's
    input), the position-embedding indices and fp32 weights (4 per patch), the fp32 rotary
    cos and sin, and the merger (LayerNorm input and stats, both Linears' inputs, GELU's).
    `cast_block_inputs`: the blocks are FSDP2 units under a bf16/fp16 policy, which casts
    their inputs, cos and sin included; each block's rotary then keeps fp32 copies of its own.
    `checkpointed` (activation checkpointing, a trainable tower): each block keeps only what
    it was called with, its input and, under `cast_block_inputs`, its cast cos and sin (the
    shared fp32 ones otherwise, counted once); one block's recomputation in backward is a
    transient (`vision_estimate`)."""
    h, c = shape.hidden, compute_bytes
    stats = 4 if device == "cuda" else c
    rotary = 2 * (h // shape.heads) * 4  # cos and sin, fp32
    if checkpointed:
        block = h * c + (2 * (h // shape.heads) * c if cast_block_inputs else 0)
    else:
        block = _vision_block(shape, c, device, cast_block_inputs)
    outside = shape.patch_dim * c + 8 * 4 + 4 * 4 + (0 if cast_block_inputs else rotary) + 4 * h * c + 2 * stats
    return patches * (shape.depth * block + outside)


def vision_estimate(vision: VisionTower, parallel: Parallel, options: StepOptions) -> MemoryEstimate:
    """The vision tower's share of a training step's memory per rank (the most loaded rank).

    Parameters: FSDP2 shards over dp_shard × cp (whole under "replicate"; replicated over
    tp: the tower has no TP plan), fp32 masters when trainable under a bf16/fp16 policy, the
    storage dtype when frozen. Gradients and optimizer state: the trainable shard's.
    Activations: `vision_activations`, checkpointed per block when `options` has activation
    checkpointing and the tower trains (`PARALLELIZER.apply` leaves a frozen tower alone:
    it keeps nothing). Transient: the root unit's vision parameters, gathered in the
    compute dtype for the whole step ("root": the whole tower), plus, while the tower runs,
    a block unit and the next one FSDP2 prefetches (backward: with the running unit's
    unsharded gradient, copied to fp32 for the reduce-scatter) and, checkpointed, one
    block's recomputed activations; the tower runs before the decoder in forward and after
    it in backward, so counting it beside the decoder's peak overstates the step's peak by
    at most that much.
    """
    shape, shards, c = vision.shape, parallel.fsdp_shards, options.compute_bytes
    blocks, outer = shape.block_parameters() * shape.depth, shape.outer_parameters()
    p = options.param_bytes if vision.trainable else vision.storage_bytes
    block = _elements(shape.block_parameters())
    if vision.layout == "replicate":
        held, gathered = _elements(blocks) + _elements(outer), 0
    elif vision.layout == "root":
        held, gathered = _shard_elements(blocks + outer, shards), shape.parameters() * c
    else:
        held = _shard_elements(blocks, shards) + _shard_elements(outer, shards)
        gathered = _elements(outer) * c + 2 * block * c + (block * (c + 4) if vision.trainable else 0)
    trained = held if vision.trainable else 0
    patches = vision.patches_per_rank(parallel) if vision.trainable else 0
    cast = vision.layout == "units" and c < options.param_bytes
    checkpointed = options.activation_checkpointing and vision.trainable
    recomputed = patches * _vision_block(shape, c, options.device, cast) if checkpointed else 0
    return MemoryEstimate(
        parameters=held * p,
        gradients=trained * p,
        optimizer_states=trained * p * OPTIMIZER_STATES[options.optimizer],
        activations=vision_activations(shape, patches, c, options.device, cast_block_inputs=cast, checkpointed=checkpointed),
        loss=0,
        transient=gathered + recomputed,
        reference_parameters=held * options.reference_bytes if options.reference_model else 0,  # a reference's tower, sharded alike
    )
