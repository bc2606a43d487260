"""How many bytes a training step of a dense Qwen3.5 holds per rank: the memory model behind `plan`.

Pure arithmetic over the model's shape (`ModelShape`), the parallel sizes (`Parallel`) and
the step's options (`StepOptions`); nothing is built or run. Per rank:

- parameters: the FSDP2 shard of every parameter (tp-sliced ones hold 1/tp of the whole),
  stored in fp32 under a bf16/fp16 policy (Accelerate upcasts trainable parameters: that
  fp32 shard *is* the master copy);
- gradients: the same shard, in the storage dtype;
- optimizer state: AdamW two moments, SGD one momentum buffer, none nothing (storage dtype);
- activations: what the decoder keeps for backward, per layer kind (GatedDeltaNet, gated
  attention, MLP, norms and residuals), or only each layer's input under activation
  checkpointing; local tokens are batch × seq_len / cp, heads and the MLP width / tp;
- loss: what the lm_head and the cross entropy keep (tiled "recompute": the hidden states
  and one fp32 per token; "hold": the gradients computed in forward, of the hidden states
  [tokens, hidden] and of the lm_head weight [vocab / tp, hidden], in the compute dtype;
  Transformers' loss: an fp32 [tokens, vocab] log-softmax);
- transient: what the step's peak adds to the above: the FSDP2 units gathered at the
  prefetch depths (with one unit's unsharded gradient in backward), and the largest of the
  loss's working bytes (`loss_transient`: one tile and the fp32 gradient accumulators, or
  Transformers' two fp32 [tokens, vocab] gradients) with the tail's gradient, and, less
  the loss's bytes (freed by then), CP's gathered K/V (and its gradient) in an attention
  layer and a layer recomputed under checkpointing;
- a VLM's vision tower (`VisionTower`, `vision_estimate`, added by `step_estimate`): its
  parameters as FSDP2 holds them (trainable or frozen, per `frozen_multimodal_sharding`),
  gradients and optimizer state when trainable, and what its blocks keep for a given number
  of image tokens (`tests/test_vlm_plan.py` checks them against the sharded tiny VLM).

The activation and loss formulas were written from what saved-tensor hooks record on the
unmodified Transformers model and on this package's CP/TP layers (`tests/test_memory_model.py`
checks them within ±10 % on CPU); the loss path's peak (`loss_saved + loss_transient`, each
mode, fp32 and bf16) from every tensor's lifetime (torch's MemTracker), within ±4 % on CPU.
The GatedDeltaNet core and the causal conv depend on the kernels: without FLA (and always
on CPU) torch's reference chunked rule (fp32 inside, per-chunk [64, 64] matrices kept) and
Transformers' torch conv; with FLA on CUDA, FLA's `chunk_gated_delta_rule` and causal-conv1d,
from what their autograd functions save (not measured here: no GPU).

Modules: `shapes` (what it reads and answers), `layers` (the decoder's activations),
`loss` (the loss path), `vision` (a VLM's tower), `step` (a step's estimate), `offload`
(activation offload's copy time per layer against the layer's compute, a stated FLOPs model),
`report` (what `plan` prints and suggests). The public names are re-exported here.
"""

from __future__ import annotations

from .layers import activations, fla_gated_delta_rule, layer_activations, torch_gated_delta_rule
from .loss import loss_block, loss_saved, loss_transient
from .offload import HOST_MEMORY_SHARE, host_per_node, layer_forward_flops, offload_timing
from .report import describe, describe_vision, longest_seq_len, memory_report, parse_bytes, suggest_cp
from .shapes import CHUNK, DEFAULT_LOSS_TILE_BYTES, OPTIMIZERS, Device, MemoryEstimate, ModelShape, Parallel, StepOptions
from .step import estimate, step_estimate
from .vision_tower import VISION_FROZEN_SHARDINGS, VisionShape, VisionTower, vision_activations, vision_estimate

__all__ = [
    "CHUNK", "DEFAULT_LOSS_TILE_BYTES", "HOST_MEMORY_SHARE", "OPTIMIZERS", "VISION_FROZEN_SHARDINGS", "Device", "MemoryEstimate", "ModelShape",
    "Parallel", "StepOptions", "VisionShape", "VisionTower", "activations", "describe", "describe_vision", "estimate",
    "fla_gated_delta_rule", "host_per_node", "layer_activations", "layer_forward_flops", "longest_seq_len", "loss_block", "loss_saved", "loss_transient",
    "memory_report", "offload_timing", "parse_bytes", "step_estimate", "suggest_cp", "torch_gated_delta_rule", "vision_activations",
    "vision_estimate",
]
