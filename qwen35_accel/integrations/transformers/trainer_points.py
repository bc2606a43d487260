"""Transformers' patch points (the Trainer's, and `from_pretrained`'s sharding), declared as data;
`integrations/patches.py` registers them with the others."""

from __future__ import annotations

from ..activation import TRANSFORMERS, PatchPoint
from . import evaluation, load_sharding, trainer_checkpoints, trainer_loss, trainer_steps

TRANSFORMERS_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(
        "transformers.trainer", "Trainer._load_from_checkpoint", trainer_checkpoints.trainer_load_from_checkpoint, TRANSFORMERS,
        "a Qwen3.5-family model under tp > 1 with FULL_STATE_DICT (resume_from_checkpoint): as load_fsdp_model above (the "
        "Trainer holds its own reference to Accelerate's function)",
    ),
    PatchPoint(
        "transformers.distributed.mixin", "DistributedMixin.maybe_distribute_model",
        load_sharding.maybe_distribute_model, TRANSFORMERS,
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
        "transformers.trainer", "Trainer._prepare_context_parallel_inputs", trainer_steps.prepare_context_parallel_inputs,
        TRANSFORMERS,
        "a Qwen3.5-family model under cp > 1: a sequence classifier's per-row labels kept whole (its padding the pad token), a "
        "token classifier's labels sharded unshifted; the batch is right-padded to a multiple of 2*cp first (padding-free collators "
        "make rows of any length; stock leaves that to the collator); TRL's DPO/KTO/GRPO/RLOO batches left whole (their "
        "fused head shards whole rows itself); with a TRL outside 1.16.x refused under cp, GRPO/RLOO under tp too",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer._track_num_input_tokens", trainer_steps.track_num_input_tokens, TRANSFORMERS,
        "a Qwen3.5-family model under cp or tp > 1: num_input_tokens_seen counts each batch once (stock sums every rank's "
        "count, and ranks differing in cp/tp hold the same batch)",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer.floating_point_ops", trainer_steps.floating_point_ops, TRANSFORMERS,
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
        "transformers.trainer", "Trainer.save_model", trainer_checkpoints.trainer_save_model, TRANSFORMERS,
        "a Qwen3.5-family model under FSDP2 with a sharded state dict type: the explicit save_model writes a Hugging Face "
        "checkpoint from the gathered weights (stock writes no weights at all)",
    ),
)
