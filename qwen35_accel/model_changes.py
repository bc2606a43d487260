"""Every change the package makes to a model's modules besides the declared patch points
(`integrations/patches.py`): class swaps, forward hooks, state-dict hooks and rebound methods, in
one registry that `qwen35-accel env` prints and `tests/test_model_changes.py` holds against the
sources (each kind of change a module makes is listed here, and nothing else is).

A class swap replaces an instance's class by a subclass of it (or, for the norms under TP, a class
of the same arithmetic) so that the subclass's `forward` runs; nothing of Transformers' classes or
modules is changed globally.
"""

from __future__ import annotations

import dataclasses

CLASS_SWAP = "class swap"
PRE_HOOK = "forward pre-hook"
HOOK = "forward hook"
STATE_DICT_HOOK = "state-dict hook"
REBIND = "method or attribute rebind"
KINDS: tuple[str, ...] = (CLASS_SWAP, PRE_HOOK, HOOK, STATE_DICT_HOOK, REBIND)


@dataclasses.dataclass(frozen=True)
class ModelChange:
    """One change: its `kind` (`KINDS`), the module of the package that makes it (`where`, dotted,
    relative to `qwen35_accel`), what it is made `on`, and `why`."""

    kind: str
    where: str
    on: str
    why: str


MODEL_CHANGES: tuple[ModelChange, ...] = (
    ModelChange(REBIND, "integrations.deepspeed.gates", "each GatedDeltaNet under DeepSpeed ZeRO",
                "its fp32 holder moved from a submodule to a plain attribute of the same name: outside DeepSpeed's "
                "cast, partitioning and optimizer (its forward and state-dict hooks find it there)"),
    ModelChange(CLASS_SWAP, "model.fp32_gate", "each GatedDeltaNet (every family)",
                "its gate computed from the fp32 `_fp32_params` holder (`Fp32Gate*GatedDeltaNet`)"),
    ModelChange(STATE_DICT_HOOK, "model.fp32_gate", "each GatedDeltaNet with a holder",
                "state dicts keep Transformers' keys (`…linear_attn.A_log`) and load them into the holder"),
    ModelChange(REBIND, "model.fp32_gate", "the model's `named_parameters`",
                "parameter names match state-dict keys (the holder's parameters under Transformers' names)"),
    ModelChange(CLASS_SWAP, "model.hub_kernels", "(the mechanism: `swap_class`)",
                "an instance's class replaced, any instance-level `forward` Transformers' kernelize bound dropped"),
    ModelChange(PRE_HOOK, "model.packing", "the text decoder",
                "packed rows: the document layout handed to the layers as `cu_seq_lens_*` (a sequence classifier refuses them)"),
    ModelChange(PRE_HOOK, "parallel.activation_checkpointing", "each checkpointed layer",
                "no cache while training (a recompute would fill it twice); then torch's composable `checkpoint` hooks"),
    ModelChange(PRE_HOOK, "parallel.activation_offload", "each checkpointed layer",
                "its saved inputs moved to host memory between forward and backward"),
    ModelChange(HOOK, "parallel.activation_offload", "each checkpointed layer",
                "the offload context left after the layer's forward"),
    ModelChange(CLASS_SWAP, "parallel.context_parallel.model", "each GatedDeltaNet and gated attention under cp",
                "the CP layers: state passing and conv halo; K/V all-gather"),
    ModelChange(PRE_HOOK, "parallel.context_parallel.model", "the model under cp",
                "inputs CP cannot compute exactly refused; packed rows and padding turned into the layers' form"),
    ModelChange(REBIND, "parallel.context_parallel.model", "the model's `loss_function` under cp",
                "the causal-LM loss over the cp group's tokens"),
    ModelChange(CLASS_SWAP, "parallel.context_parallel.heads", "a classification head under cp",
                "a sequence classifier's last real token pooled across ranks; a token classifier's loss over the group"),
    ModelChange(PRE_HOOK, "parallel.context_parallel.vision_split", "a VLM under cp",
                "the vision tower's work split over the cp ranks"),
    ModelChange(PRE_HOOK, "parallel.vision_placeholder", "a VLM whose vision blocks are FSDP2 units",
                "the tower runs on a zero placeholder image in forwards without images"),
    ModelChange(CLASS_SWAP, "parallel.tiled_loss", "the causal LM (every family)",
                "training forwards with labels compute the loss in blocks, never `[tokens, vocab]`"),
    ModelChange(CLASS_SWAP, "parallel.tensor_parallel.plan", "q_norm/k_norm, gated norms, LoRA factors kept whole under tp",
                "the norms' replicated weights and whole LoRA factors get their gradients all-reduced over tp"),
    ModelChange(PRE_HOOK, "parallel.tensor_parallel.plan", "each token mixer and MLP under tp; the lm_head; the model",
                "f (identity forward, all-reduce backward) on the block's input; generation refused with a vocab-parallel lm_head"),
    ModelChange(HOOK, "parallel.tensor_parallel.plan", "each token mixer and MLP under tp",
                "g (all-reduce forward) on the block's output"),
    ModelChange(STATE_DICT_HOOK, "parallel.tensor_parallel.plan", "each split decoder layer",
                "state dicts in Transformers' layout (the slices gathered; loads sliced)"),
    ModelChange(REBIND, "parallel.tensor_parallel.plan", "the model's `loss_function` with a vocab-parallel lm_head",
                "the loss combines the vocab slices without gathering the logits"),
    ModelChange(STATE_DICT_HOOK, "parallel.tensor_parallel.state_dict", "the optimizer under tp",
                "optimizer state in Transformers' layout"),
    ModelChange(HOOK, "integrations.transformers.trainer_loss", "the model, for one call (removed after it)",
                "the model's loss recorded to check the Trainer's stock scaling once per trainer"),
    ModelChange(PRE_HOOK, "integrations.trl.whole_rows", "the model under cp in TRL's DPO/KTO/GRPO/RLOO",
                "whole rows sharded on entry, left-padded rows left-aligned"),
    ModelChange(REBIND, "integrations.trl.fused_head", "the model's `forward` (TRL's fused LM head under cp or tp)",
                "TRL's fused head computes from this rank's chunks or vocab slice"),
    ModelChange(HOOK, "integrations.trl.fused_head", "the routers, for one fused forward (removed after it)",
                "the router logits recorded for the router's loss of the fused path"),
)


def model_changes_table() -> list[dict[str, str]]:
    """The registry as rows (kind, where, on, why): what `qwen35-accel env --json` carries."""
    return [dataclasses.asdict(change) for change in MODEL_CHANGES]
