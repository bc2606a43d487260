"""Accelerate's patch points, declared as data (each point's target, wrapper, guard and what it does);
`integrations/patches.py` registers them with the others."""

from __future__ import annotations

from .. import activation
from ..activation import ACCELERATE, PatchPoint
from . import (
    accelerator_prepare_model,
    cpu_backend,
    deepspeed_preparation,
    fsdp_checkpoints,
    preparation,
    several_models,
    step_context,
)

ACCELERATE_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(
        "accelerate.state", "PartialState._prepare_backend", cpu_backend.prepare_backend, ACCELERATE,
        "no accelerator, WORLD_SIZE > 1 and an FSDP or DeepSpeed config: gloo backend (then MULTI_CPU, or DeepSpeed over "
        "gloo; stock: DistributedType.NO, one process per rank)",
    ),
    PatchPoint(
        "accelerate.state", "AcceleratorState.__init__", cpu_backend.accelerator_state_init, ACCELERATE,
        "then MULTI_CPU with an FSDP2 plugin becomes DistributedType.FSDP (stock ignores the plugin on CPU); an FSDP1 "
        "plugin stays MULTI_CPU (FSDP1 has no CPU path), said once",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.__init__", activation.accelerator_init, ACCELERATE,
        "every model: refuses dp_replicate > 1 with dp_shard 1 and cp > 1 (tp > 1 too before Accelerate 1.16) before "
        "Accelerate does, naming the layouts that work; then the deferred points whose modules are imported by now (a Trainer subclass may "
        "prepare a reference model before any prepare call)",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.prepare", several_models.prepare, ACCELERATE,
        "several dense Qwen3.5 models under FSDP2: those no optimizer holds (a frozen reference) get our units too "
        "(stock: 'Only one model is supported when using FSDP2')",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.prepare_model", accelerator_prepare_model.prepare_model, ACCELERATE,
        "Qwen3.5 under FSDP v1: refused on every rank, naming accelerate to-fsdp2; without FSDP (one process, DDP): fp32 gate holders before Accelerate wraps the model, the "
        "checkpoint's fp32 gate values read back after a bf16 load (stock: the gates train as loaded, bf16 for a "
        "bf16 load)",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator._prepare_tp", preparation.prepare_tp, ACCELERATE,
        "a Qwen3.5-family model: Accelerate's load-time TP path is skipped; the parallelizer splits the model by heads",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator._prepare_cp", preparation.prepare_cp, ACCELERATE,
        "a Qwen3.5-family model: no torch ring-attention hooks; the step's CP context becomes ours",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator._prepare_fsdp2", preparation.prepare_fsdp2, ACCELERATE,
        "a Qwen3.5-family model: fp32 gate holders installed before Accelerate records parameter names",
    ),
    PatchPoint(
        "accelerate.accelerator", "fsdp2_apply_ac", preparation.fsdp2_apply_ac, ACCELERATE,
        "a Qwen3.5-family model: skipped; the parallelizer checkpoints each decoder layer and trainable vision block",
    ),
    PatchPoint(
        "accelerate.accelerator", "fsdp2_prepare_model", preparation.fsdp2_prepare_model, ACCELERATE,
        "a Qwen3.5-family model: PARALLELIZER.apply with the FSDP plugin's settings and the accelerator's mesh",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.maybe_context_parallel", step_context.maybe_context_parallel, ACCELERATE,
        "a Qwen3.5-family model under cp > 1: shards the step's buffers with qwen35_accel's layout",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.clip_grad_norm_", step_context.clip_grad_norm, ACCELERATE,
        "a Qwen3.5-family model under tp > 1: the norm of the whole gradient (split parameters summed over the tp group)",
    ),
    PatchPoint(
        "accelerate.accelerator", "load_fsdp_model", fsdp_checkpoints.load_fsdp_model, ACCELERATE,
        "a Qwen3.5-family model under tp > 1 with FULL_STATE_DICT (Accelerator.load_state): rank 0's file broadcast into the "
        "per-head slices (torch's full-state-dict loading copies full tensors into them)",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator._prepare_deepspeed", deepspeed_preparation.prepare_deepspeed, ACCELERATE,
        "a Qwen3.5-family model under DeepSpeed ZeRO-1/2/3: fp32 gate holders (the checkpoint's values after a bf16 "
        "load) kept out of the engine's cast, partitioning and optimizer, trained in fp32 beside it (DeepSpeed's "
        "points below; zero.Init-partitioned gates gathered first); fp16, ZeRO stage 0 and DeepSpeed's sequence "
        "parallelism (Ulysses: each GatedDeltaNet would restart its state per rank; the FSDP2 path's CP named) refused "
        "on every rank with the reason (stock: the gates are bf16 under bf16, and ZeRO-3 refuses fp32 ones)",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.get_state_dict", deepspeed_preparation.get_state_dict, ACCELERATE,
        "such a model: the gates added in fp32 under the Transformers keys (the Trainer's save; ZeRO-3's 16-bit "
        "state dict lacks them)",
    ),
)
