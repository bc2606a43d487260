"""The plugin's patch points: one registry, each point with its target, guard and wrapper.

Each patch point wraps one attribute of Accelerate or the Trainer and calls the original
for anything that is not a model it acts on (a Qwen3.5-family model: Qwen3.5 dense and MoE, Qwen3-Next,
Qwen4-Exp; some points dense Qwen3.5 only, as each says). This module is data: it imports the
wrappers and declares the points; `activation` (which imports no wrapper) installs them
(`install()` is idempotent), restores the originals (`uninstall()`) and reports what is
active and why not (`status()`). The public names are in `accelerate.py`.
"""

from __future__ import annotations

from . import (
    accelerator_prepare_model,
    activation,
    checkpoints,
    cpu_backend,
    evaluation,
    preparation,
    several_models,
    step_hooks,
    trainer_loss,
    trl_fused_head,
    trl_sampling,
    transformers_sharding,
    trl_whole_rows,
)
from .activation import ACCELERATE, TRANSFORMERS, TRL, PatchPoint

PATCH_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(
        "accelerate.state", "PartialState._prepare_backend", cpu_backend.prepare_backend, ACCELERATE,
        "no accelerator, WORLD_SIZE > 1 and an FSDP config: gloo backend, MULTI_CPU (stock: DistributedType.NO)",
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
        "accelerate.accelerator", "Accelerator.maybe_context_parallel", step_hooks.maybe_context_parallel, ACCELERATE,
        "a Qwen3.5-family model under cp > 1: shards the step's buffers with qwen35_accel's layout",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.clip_grad_norm_", step_hooks.clip_grad_norm, ACCELERATE,
        "a Qwen3.5-family model under tp > 1: the norm of the whole gradient (split parameters summed over the tp group)",
    ),
    PatchPoint(
        "accelerate.accelerator", "load_fsdp_model", checkpoints.load_fsdp_model, ACCELERATE,
        "a Qwen3.5-family model under tp > 1 with FULL_STATE_DICT (Accelerator.load_state): rank 0's file broadcast into the "
        "per-head slices (torch's full-state-dict loading copies full tensors into them)",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer._load_from_checkpoint", checkpoints.trainer_load_from_checkpoint, TRANSFORMERS,
        "a Qwen3.5-family model under tp > 1 with FULL_STATE_DICT (resume_from_checkpoint): as load_fsdp_model above (the "
        "Trainer holds its own reference to Accelerate's function)",
    ),
    PatchPoint(
        "transformers.distributed.mixin", "DistributedMixin.maybe_distribute_model",
        transformers_sharding.maybe_distribute_model, TRANSFORMERS,
        "a Qwen3.5-family model loaded with Transformers' own sharding (from_pretrained(..., distributed_config=...)): data "
        "parallelism alone sharded by the plugin's parallelizer at load (fp32 gate holders, loaded bitwise); with tp/pp a bf16 "
        "load or fsdp_mixed_precision under FSDP refused on every rank with the ways that keep the gates fp32 (stock: "
        "the gates train bf16-rounded, silently); Transformers' gathering TP plan said once",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer.compute_loss", trainer_loss.trainer_compute_loss, TRANSFORMERS,
        "Qwen3.5-MoE whose forward adds the router's load-balancing loss, any layout (one process and DDP too): the "
        "router term counted once per step, coef x aux / gradient_accumulation_steps, the cross entropy scaled as "
        "stock (stock multiplies the whole loss by num_processes // tp: the router term num_processes times too "
        "strong, and once more per accumulated micro-batch; Transformers issue 48690); the stock scaling checked at "
        "each trainer's first call. A Qwen3.5 classification head (reward model): its per-rank mean loss never multiplied, divided "
        "by the micro-batches (stock: num_processes x accumulation times one process's loss and gradient)",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer._prepare_context_parallel_inputs", step_hooks.prepare_context_parallel_inputs,
        TRANSFORMERS,
        "a Qwen3.5-family model under cp > 1: a sequence classifier's per-row labels kept whole (its padding the pad token), a "
        "token classifier's labels sharded unshifted; the batch is right-padded to a multiple of 2*cp first (padding-free collators "
        "make rows of any length; stock leaves that to the collator); TRL's DPO/KTO/GRPO/RLOO batches left whole (their "
        "fused head shards whole rows itself); with a TRL outside 1.16.x refused under cp, GRPO/RLOO under tp too",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer._track_num_input_tokens", step_hooks.track_num_input_tokens, TRANSFORMERS,
        "a Qwen3.5-family model under cp or tp > 1: num_input_tokens_seen counts each batch once (stock sums every rank's "
        "count, and ranks differing in cp/tp hold the same batch)",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer.floating_point_ops", step_hooks.floating_point_ops, TRANSFORMERS,
        "a Qwen3.5-family model under cp or tp > 1: total_flos counts each batch once, with the unsplit model's parameters "
        "(stock sums every rank's estimate of the same batch, each with its own tp slices' parameter count)",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer.evaluation_loop", evaluation.evaluation_loop, TRANSFORMERS,
        "a Qwen3.5-family model under cp or tp > 1: the loop's gather_function gathers over the data-parallel ranks only (ranks "
        "differing in cp/tp hold the same batch; stock returns each row cp*tp times), every other gather_for_metrics "
        "stays stock; under cp > 1 TRL SFTTrainer's loss-only prediction_step runs inside the CP context; with "
        "QWEN35_ACCEL_CP_METRICS_PER_CHUNK=1: preprocess_logits_for_metrics runs on "
        "each rank's chunks (in prediction_step), not on the assembled logits",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer.prediction_step", evaluation.prediction_step, TRANSFORMERS,
        "a Qwen3.5-family model under cp > 1 or a vocab-parallel lm_head: the logits of the whole sequence and vocab (stock: "
        "this rank's chunks); label-less batches run inside the CP context",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer.save_model", checkpoints.trainer_save_model, TRANSFORMERS,
        "a Qwen3.5-family model under FSDP2 with a sharded state dict type: the explicit save_model writes a Hugging Face "
        "checkpoint from the gathered weights (stock writes no weights at all)",
    ),
    *(
        PatchPoint(
            f"trl.trainer.{module}", "prepare_fsdp", several_models.trl_prepare_fsdp(trainer), TRL,
            f"{trainer}'s reference model, dense Qwen3.5 under FSDP2: our units and CP/TP layers (stock TRL: one "
            "fully_shard on the whole model)",
        )
        for module, trainer in (("dpo_trainer", "DPOTrainer"), ("grpo_trainer", "GRPOTrainer"),
                                ("rloo_trainer", "RLOOTrainer"), ("kto_trainer", "KTOTrainer"))
    ),
    *(
        PatchPoint(
            f"trl.trainer.{module}", "add_fused_lm_head", trl_fused_head.trl_add_fused_lm_head, TRL,
            f"{trainer}'s fused LM head on a dense Qwen3.5 model with a vocab-parallel lm_head: per-token log-probs, "
            "entropy and top-1 over the whole vocabulary (stock TRL: over this rank's vocab slice); under cp, a call "
            "on whole rows (unshifted labels) sharded on entry (a forward pre-hook on the model, labels shifted over "
            "the whole row) and its per-token fields all-gathered back",
        )
        for module, trainer in (("sft_trainer", "SFTTrainer"), ("dpo_trainer", "DPOTrainer"),
                                ("grpo_trainer", "GRPOTrainer"), ("rloo_trainer", "RLOOTrainer"),
                                ("kto_trainer", "KTOTrainer"))
    ),
    PatchPoint(
        "trl.trainer.sft_trainer", "SFTTrainer.compute_loss", trl_fused_head.sft_compute_loss, TRL,
        "SFTTrainer on a dense Qwen3.5 model under cp > 1, training without num_items_in_batch (the VLM class takes "
        "no loss kwargs): the loss over the cp group's label tokens, cp x (local sum / group count) (stock TRL: "
        "each rank's mean over its own chunks, averaged by FSDP2: a wrong loss and gradient)",
    ),
    *(
        PatchPoint(
            f"trl.trainer.{module}", f"{trainer}.{method}", trl_whole_rows.trl_counted_once, TRL,
            f"{trainer}.{method} on a dense Qwen3.5 model under cp > 1 (the reference precompute also under tp > 1): "
            "TRL's metric gathers (accelerator.gather, gather_for_metrics through it; bound on the accelerator for the "
            "call) keep one copy of each cp (cp×tp) group's whole rows (stock: cp copies: num_tokens cp times, "
            "precomputed reference log-probs duplicated)",
        )
        for module, trainer in (("dpo_trainer", "DPOTrainer"), ("kto_trainer", "KTOTrainer"))
        for method in ("compute_loss", "_precompute_ref_logps")
    ),
    *(
        point
        for module, trainer in (("grpo_trainer", "GRPOTrainer"), ("rloo_trainer", "RLOOTrainer"))
        for point in (
            PatchPoint(
                f"trl.trainer.{module}", f"{trainer}.get_train_dataloader", trl_sampling.trl_sampling_setup, TRL,
                f"{trainer} on a dense Qwen3.5 model under cp or tp > 1, before train() reads the generation batch: "
                "each cp×tp group one data-parallel replica: "
                "seeded seed + dp index (stock: + process index), generation_batch_size counting dp replicas (stock: "
                "processes); vLLM, continuous batching, rollout functions, tools, environments (and images under cp) "
                "refused on every rank",
            ),
            *(
                PatchPoint(
                    f"trl.trainer.{module}", f"{trainer}.{method}", trl_sampling.trl_replica_view, TRL,
                    f"{trainer}.{method} on a dense Qwen3.5 model under cp or tp > 1: the trainer's accelerator seen "
                    "as the replica's for the call (process_index the dp index, num_processes dp, gathers keeping one "
                    "copy of each group's rows; stock: cp*tp copies and per-process slices)",
                )
                for method in ("_generate_and_score_completions", "_compute_loss")
            ),
            PatchPoint(
                f"trl.trainer.{module}", f"{trainer}._generate_single_turn", trl_sampling.trl_generate_without_cp, TRL,
                f"{trainer} generation on a dense Qwen3.5 model under cp or tp > 1: the model's CP paused (whole "
                "sequences and a cache on every rank; stock: refused, the CP model takes no cache), the units gathered "
                "once per call where they fit; with QWEN35_ACCEL_RL_GENERATION=split (any world): per-row sampling, "
                "under cp > 1 each cp rank 1/cp of the rows (stock: one RNG stream per process)",
            ),
            PatchPoint(
                f"trl.trainer.{module}", "gather", trl_sampling.trl_gather_once, TRL,
                f"{trainer}'s module-level gather (rewards, RLOO's KL) inside a replica view: one copy per replica "
                "(stock: cp*tp copies)",
            ),
            PatchPoint(
                f"trl.trainer.{module}", "gather_object", trl_sampling.trl_gather_object_once, TRL,
                f"{trainer}'s module-level gather_object (logged prompts, completions, metric names) inside a "
                "replica view: the replicas' leading ranks only (stock: cp*tp copies)",
            ),
        )
    ),
)

activation.register(PATCH_POINTS)
