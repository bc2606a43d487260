"""TRL's patch points, declared as data; `integrations/patches.py` registers them with the others. TRL is
optional: these points wait until TRL's trainer modules are imported, and act only within the TRL
guard's range."""

from __future__ import annotations

from ..activation import TRL, PatchPoint
from . import fused_head, reference_model, sampling, whole_rows

# The trainers with a reference model TRL prepares itself (`prepare_fsdp`, `prepare_deepspeed`).
_REFERENCE_TRAINERS = (("dpo_trainer", "DPOTrainer"), ("grpo_trainer", "GRPOTrainer"), ("rloo_trainer", "RLOOTrainer"),
                       ("kto_trainer", "KTOTrainer"))

TRL_POINTS: tuple[PatchPoint, ...] = (
    *(
        PatchPoint(
            f"trl.trainer.{module}", "prepare_fsdp", reference_model.trl_prepare_fsdp(trainer), TRL,
            f"{trainer}'s reference model, dense Qwen3.5 under FSDP2: our units and CP/TP layers (stock TRL: one "
            "fully_shard on the whole model)",
        )
        for module, trainer in _REFERENCE_TRAINERS
    ),
    *(
        PatchPoint(
            f"trl.trainer.{module}", "prepare_deepspeed", reference_model.trl_prepare_deepspeed(trainer), TRL,
            f"{trainer}'s reference (and reward, precompute) model under DeepSpeed, Qwen3.5 family: its gates in "
            "fp32 holders the inference engine never casts, read in fp32 (stock TRL: bf16 gates under bf16)",
        )
        for module, trainer in _REFERENCE_TRAINERS
    ),
    *(
        PatchPoint(
            f"trl.trainer.{module}", "add_fused_lm_head", fused_head.trl_add_fused_lm_head, TRL,
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
        "trl.trainer.sft_trainer", "SFTTrainer.compute_loss", fused_head.sft_compute_loss, TRL,
        "SFTTrainer on a dense Qwen3.5 model under cp > 1, training without num_items_in_batch (the VLM class takes "
        "no loss kwargs): the loss over the cp group's label tokens, cp x (local sum / group count) (stock TRL: "
        "each rank's mean over its own chunks, averaged by FSDP2: a wrong loss and gradient)",
    ),
    *(
        PatchPoint(
            f"trl.trainer.{module}", f"{trainer}.{method}", whole_rows.trl_counted_once, TRL,
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
                f"trl.trainer.{module}", f"{trainer}.get_train_dataloader", sampling.trl_sampling_setup, TRL,
                f"{trainer} on a dense Qwen3.5 model under cp or tp > 1, before train() reads the generation batch: "
                "each cp×tp group one data-parallel replica: "
                "seeded seed + dp index (stock: + process index), generation_batch_size counting dp replicas (stock: "
                "processes); vLLM, continuous batching, rollout functions, tools, environments (and images under cp) "
                "refused on every rank",
            ),
            *(
                PatchPoint(
                    f"trl.trainer.{module}", f"{trainer}.{method}", sampling.trl_replica_view, TRL,
                    f"{trainer}.{method} on a dense Qwen3.5 model under cp or tp > 1: the trainer's accelerator seen "
                    "as the replica's for the call (process_index the dp index, num_processes dp, gathers keeping one "
                    "copy of each group's rows; stock: cp*tp copies and per-process slices)",
                )
                for method in ("_generate_and_score_completions", "_compute_loss")
            ),
            PatchPoint(
                f"trl.trainer.{module}", f"{trainer}._generate_single_turn", sampling.trl_generate_without_cp, TRL,
                f"{trainer} generation on a dense Qwen3.5 model under cp or tp > 1: the model's CP paused (whole "
                "sequences and a cache on every rank; stock: refused, the CP model takes no cache), the units gathered "
                "once per call where they fit; with QWEN35_ACCEL_RL_GENERATION=split (any world): per-row sampling, "
                "under cp > 1 each cp rank 1/cp of the rows (stock: one RNG stream per process)",
            ),
            PatchPoint(
                f"trl.trainer.{module}", "gather", sampling.trl_gather_once, TRL,
                f"{trainer}'s module-level gather (rewards, RLOO's KL) inside a replica view: one copy per replica "
                "(stock: cp*tp copies)",
            ),
            PatchPoint(
                f"trl.trainer.{module}", "gather_object", sampling.trl_gather_object_once, TRL,
                f"{trainer}'s module-level gather_object (logged prompts, completions, metric names) inside a "
                "replica view: the replicas' leading ranks only (stock: cp*tp copies)",
            ),
        )
    ),
)
