"""Head-parallel tensor parallelism for dense Qwen3.5 (Megatron style, local tensors).

Each tp rank keeps whole heads: its slice of every head-indexed projection, and runs the
token mixers on those heads only. In particular each rank's GatedDeltaNet recurrence runs
on num_value_heads / tp heads (Transformers' plan gathers every projection and runs all of
them on every rank). Per decoder layer:

- GatedDeltaNet: the q, k and v segments of the fused `in_proj_qkv` by key / value heads
  (rank r owns key heads r·Hk/tp… and the value heads they serve, so GQA stays local),
  `conv1d` channels to match, `in_proj_z`/`in_proj_b`/`in_proj_a` and the gate holder's
  `A_log`/`dt_bias` by value heads, the gated norm replicated (per head), `out_proj` by
  input columns;
- attention: `q_proj` (query and output gate of each head), `k_proj`, `v_proj` by heads,
  `q_norm`/`k_norm` replicated, `o_proj` by input columns;
- MLP: `gate_proj`/`up_proj` by rows, `down_proj` by columns.
Each block's input is the identity forward / all-reduce backward, its output an
all-reduce forward / identity backward; replicated weights used on local heads (the
norms) get their gradients all-reduced. Embeddings, layer norms and lm_head stay
replicated (the lm_head optionally split by vocab). Parameters are plain tensors holding
the local slice, so FSDP2 over the `dp_shard_cp` mesh and context parallelism compose
unchanged. State dicts and optimizer state stay in Transformers' layout.

Modules: `splits` (how a parameter is split; which are), `plan` (the split, its hooks,
the vocab-parallel lm_head), `state_dict` (Transformers' layout, optimizer state,
full-state loading), `clipping` (`clip_grad_norm_`). The vocab-parallel loss lives in
`qwen35_accel.parallel.losses` (re-exported here), Megatron's f and g (`copy_to_group`,
`reduce_from_group`) in `qwen35_accel.parallel.collectives`.
"""

from ..losses import IGNORE_INDEX, VocabParallelCausalLMLoss, vocab_parallel_cross_entropy
from .clipping import clip_grad_norm_
from .splits import TP_GROUP_ATTR, Slicer, tensor_parallel_group, tensor_parallel_numel_elsewhere, tensor_parallel_sliced
from .plan import (
    TensorParallelRMSNorm,
    TensorParallelRMSNormGated,
    apply_tensor_parallel,
    apply_vocab_parallel_lm_head,
    check_divisible,
    check_no_cpu_offload,
    check_vocab_parallel,
    gather_vocab_parallel_logits,
)
from .state_dict import (
    _state_dict_shapes_only,  # noqa: F401  (tests)
    gather_tensor_parallel,
    load_full_state_dict,
    register_optimizer_state_layout,
)

__all__ = [
    "IGNORE_INDEX",
    "TP_GROUP_ATTR",
    "Slicer",
    "TensorParallelRMSNorm",
    "TensorParallelRMSNormGated",
    "VocabParallelCausalLMLoss",
    "apply_tensor_parallel",
    "apply_vocab_parallel_lm_head",
    "check_divisible",
    "check_no_cpu_offload",
    "check_vocab_parallel",
    "clip_grad_norm_",
    "gather_tensor_parallel",
    "gather_vocab_parallel_logits",
    "load_full_state_dict",
    "register_optimizer_state_layout",
    "tensor_parallel_group",
    "tensor_parallel_numel_elsewhere",
    "tensor_parallel_sliced",
    "vocab_parallel_cross_entropy",
]
