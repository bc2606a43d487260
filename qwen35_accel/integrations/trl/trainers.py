"""TRL's trainers the plugin knows: which compute log-probabilities, which of those run on whole
rows under context parallelism, which sample; how to recognise one; the errors that refuse them
under context or tensor parallelism."""

from __future__ import annotations

from typing import Any

# TRL trainers that compute log-probabilities of whole sequences from `model(..., fused_lm_head=True)`:
# the Trainer must not shard their batches under context parallelism.
TRL_LOGPROB_TRAINERS = ("DPOTrainer", "GRPOTrainer", "RLOOTrainer", "KTOTrainer")
# Those that run under qwen35_accel's CP with TRL 1.16 (`trl_whole_rows`): their fused-head calls on
# whole rows are sharded on entry and the per-token fields gathered back.
TRL_WHOLE_ROW_TRAINERS = ("DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer")
# TRL trainers that sample completions per process: stock TRL seeds each process on its own
# (`set_seed(..., device_specific=True)`) and slices the batch by process index, so the ranks of a
# cp×tp group would generate, and then train on, different sequences; with TRL 1.16 `trl_sampling`
# makes each group one data-parallel replica. Other TRL versions are refused under cp/tp.
TRL_SAMPLING_TRAINERS = ("GRPOTrainer", "RLOOTrainer")


def trl_trainer(trainer: Any, names: tuple[str, ...]) -> str | None:
    """The name of the TRL class among `names` that `trainer` is (or derives from), else None."""
    for cls in type(trainer).__mro__:
        if cls.__module__.startswith("trl.") and cls.__name__ in names:
            return cls.__name__
    return None


def trl_under_tp_error(trainer: str, tp_size: int, trl_version: str | None = None) -> NotImplementedError:
    """The refusal of a sampling trainer under tensor parallelism outside TRL's tested range."""
    return NotImplementedError(
        f"TRL's {trainer} under tensor parallelism (tp_size={tp_size}) runs with qwen35_accel for TRL 1.16.x only "
        f"(found trl {trl_version}): stock TRL seeds every process differently for sampling and slices each step's "
        "completions by process index, so the tp ranks of a group, which must see the same tokens, would generate and "
        "train on different completions; the plugin makes each group one replica against TRL 1.16's internals. "
        f"Install trl>=1.16,<1.17, or run {trainer} with tp_size 1."
    )


def trl_under_cp_error(trainer: str, cp_size: int, trl_version: str | None = None) -> NotImplementedError:
    """The refusal of `trainer` under context parallelism outside TRL's tested range
    (`trl_version`: the installed one)."""
    if trainer in TRL_WHOLE_ROW_TRAINERS:
        return NotImplementedError(
            f"TRL's {trainer} under context parallelism (cp_size={cp_size}) runs with qwen35_accel for TRL 1.16.x only "
            f"(found trl {trl_version}): its log-probabilities of whole rows are computed through TRL 1.16's fused LM "
            f"head, whose internals the plugin was written against. Install trl>=1.16,<1.17, or run {trainer} with "
            "cp_size 1."
        )
    return NotImplementedError(
        f"TRL's {trainer} under context parallelism (cp_size={cp_size}) is not supported for Qwen3.5 by "
        f"qwen35_accel: {trainer} generates its completions, which the model under CP cannot (no cache), and its "
        f"log-probabilities are not computed over whole rows yet. Run {trainer} with cp_size 1 (FSDP2 works); "
        "DPOTrainer and KTOTrainer run under CP."
    )
