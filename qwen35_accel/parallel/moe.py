"""What the Qwen3.5-MoE family takes from the parallelizer so far (issue 46, docs/moe_design.md).

Slice 2 of the design: fp32 gate holders and dtype-uniform FSDP2 units per decoder layer
(the router and the 3-D experts in the layer's unit), activation checkpointing and offload,
data parallelism (FSDP2, HSDP) only, the tiled loss (the router's load-balancing loss added
where Transformers adds it). Context and tensor parallelism, and the VLM class, are refused on
every rank with the reason until their slices land.
"""

from __future__ import annotations

from ..model.detect import Qwen35Parts


def check_moe_layout(parts: Qwen35Parts, *, cp_size: int, tp_size: int) -> None:
    """Raise (the same on every rank: sizes and classes only) where the MoE family asks for
    what is not built yet. No-op for the dense family."""
    if parts.family != "moe":
        return
    refused = []
    if cp_size > 1:
        refused.append(f"context parallelism (cp {cp_size})")
    if tp_size > 1:
        refused.append(f"tensor parallelism (tp {tp_size})")
    if parts.vision_model is not None:
        refused.append("the vision-language class (Qwen3_5MoeForConditionalGeneration)")
    if refused:
        raise NotImplementedError(
            f"qwen35_accel prepares Qwen3.5-MoE models with data parallelism (FSDP2/HSDP) only so far; "
            f"{', '.join(refused)} is not built for them yet (docs/moe_design.md). Use cp 1 and tp 1 with "
            "Qwen3_5MoeForCausalLM, or the dense family for those layouts."
        )
