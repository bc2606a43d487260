"""What the Qwen3.5-MoE family takes from the parallelizer so far (issue 46, docs/moe_design.md).

Slices 2 and 3 of the design: fp32 gate holders and dtype-uniform FSDP2 units per decoder
layer (the router and the 3-D experts in the layer's unit), activation checkpointing and
offload, data parallelism (FSDP2, HSDP), context parallelism (the dense CP layers; the router's
load-balancing loss from its three sums reduced over the cp group, `router_balance_loss`), the
tiled loss; the causal LM and the VLM class alike. Expert parallelism: `parallel.expert_parallel`;
tensor parallelism (head-parallel mixers, the shared expert as an MLP, the routed experts whole
over the tp ranks): `parallel.tensor_parallel`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...model.state import own_state
from ..options import MOE_BALANCE_CHOICES as BALANCE_CHOICES  # declared with its knob


EXPERT_WEIGHTS: tuple[str, ...] = ("gate_up_proj", "down_proj")  # the routed experts' 3-D weights

# How the router's load-balancing loss counts tokens (BALANCE_CHOICES): "rank" — each data-parallel
# rank's own (Transformers' meaning; whole rows under cp), "global" — every data-parallel rank's (the
# global batch, Qwen's recipe): its sums all-reduced over dp_shard × cp.


def router_loss_coefficient(model: torch.nn.Module) -> float:
    """The coefficient a Qwen3.5-MoE model's forward multiplies its router's load-balancing loss by,
    read where Transformers' forward reads it: the causal LM's `router_aux_loss_coef` attribute (set
    from the config at init), the VLM's text config (read at every call)."""
    coefficient = getattr(model, "router_aux_loss_coef", None)
    return float(model.config.get_text_config().router_aux_loss_coef if coefficient is None else coefficient)


def check_no_expert_adapters(moe_blocks: tuple[torch.nn.Module, ...]) -> None:
    """NotImplementedError (the same on every rank) for PEFT adapters on the routed experts'
    3-D weights (`LoraConfig(target_parameters=[...experts...])`: PEFT wraps the experts module):
    neither their FSDP2 units, expert or tensor parallelism nor checkpoints are built for the
    wrapper. Adapters on linear layers (the mixers, the shared expert) are supported."""
    wrapped = [type(block.experts).__name__ for block in moe_blocks if hasattr(block.experts, "base_layer")]
    if wrapped:
        raise NotImplementedError(
            f"PEFT adapters on the routed experts ({wrapped[0]} around {len(wrapped)} layers' experts, PEFT's "
            "target_parameters) are not supported by qwen35_accel; target the linear layers (target_modules: the "
            "attention and GatedDeltaNet projections, the shared expert) and leave the 3-D expert weights out."
        )


def check_global_balance(*, dp_replicate: int) -> None:
    """`moe_balance="global"` is refused with HSDP (`dp_replicate` > 1: the group would have to
    span a 2-D mesh, not built); before any change, on every rank."""
    if dp_replicate > 1:
        raise NotImplementedError(
            f"moe_balance='global' with HSDP (dp_replicate {dp_replicate}) is not built: the router's sums would cover "
            "one replica's ranks only. Use moe_balance='rank', or FSDP2 without replication."
        )


def install_global_balance(model: torch.nn.Module, fsdp_mesh: Any) -> None:
    """Make `model`'s router loss count the tokens of every rank of `fsdp_mesh` (dp_shard × cp,
    1-D: `check_global_balance` first)."""
    own_state(model).balance_group = fsdp_mesh.get_group()


def router_balance_loss(
    router_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    padding_mask: torch.Tensor | None,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Transformers' `load_balancing_loss_func` (Switch Transformer's auxiliary loss) over the
    tokens of a group: `num_experts · Σ_e (tokens routed to e / N) · (Σ p_e / N)`, N the real
    tokens of every layer. Its three sums (assignments per expert, probability per expert, N)
    are this rank's tokens' and are summed over `group` (the cp group: whole rows; or every
    rank of dp_shard × cp: the global batch) before the product, so the value is one process's
    on those tokens; the gradient is this rank's share, scaled by the group size for FSDP2's
    average over dp_shard × cp (as `losses.reduce_token_loss`).

    `router_logits`: per MoE layer `[local tokens, num_experts]`; `padding_mask`: `[batch,
    local seq]` (1 real, 0 padding) or None. fp32 scalar."""
    device = router_logits[0].device
    assigned = torch.zeros(num_experts, device=device, dtype=torch.float32)
    probability = torch.zeros(num_experts, device=device, dtype=torch.float32)
    rows = torch.zeros((), device=device, dtype=torch.float32)
    weight = None if padding_mask is None else padding_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        ones = torch.ones(chosen.numel(), device=device) if weight is None else weight[:, None].expand(-1, top_k).reshape(-1)
        assigned = assigned.scatter_add(0, chosen.reshape(-1), ones)
        probability = probability + (probs if weight is None else probs * weight[:, None]).sum(dim=0)
        rows = rows + (probs.shape[0] if weight is None else weight.sum())
    totals = torch.cat([assigned, rows[None], probability.detach()])
    dist.all_reduce(totals, group=group)
    all_assigned, all_rows, all_probability = totals[:num_experts], totals[num_experts], totals[num_experts + 1 :]
    value = num_experts * (all_assigned * all_probability).sum() / all_rows**2
    seed = num_experts * (all_assigned * probability).sum() / all_rows**2 * dist.get_world_size(group)
    return seed + (value - seed).detach()
