"""TRL's trainers the plugin knows: which compute log-probabilities, which sample; how to
recognise one; the errors that refuse them under context or tensor parallelism."""

from __future__ import annotations

from typing import Any

# TRL trainers that compute log-probabilities of whole sequences from the logits they receive
# (under CP: this rank's chunks), so they cannot run under our context parallelism.
TRL_LOGPROB_TRAINERS = ("DPOTrainer", "GRPOTrainer", "RLOOTrainer", "KTOTrainer")
# TRL trainers that sample completions per process: each process gets its own seed
# (`set_seed(..., device_specific=True)`) and its slice of the batch by process index, so
# the ranks of a tp group would generate, and then train on, different sequences.
TRL_SAMPLING_TRAINERS = ("GRPOTrainer", "RLOOTrainer")


def trl_trainer(trainer: Any, names: tuple[str, ...]) -> str | None:
    """The name of the TRL class among `names` that `trainer` is (or derives from), else None."""
    for cls in type(trainer).__mro__:
        if cls.__module__.startswith("trl.") and cls.__name__ in names:
            return cls.__name__
    return None


def trl_under_tp_error(trainer: str, tp_size: int) -> NotImplementedError:
    return NotImplementedError(
        f"TRL's {trainer} under tensor parallelism (tp_size={tp_size}) is not supported for Qwen3.5 by qwen35_accel: "
        "TRL seeds every process differently for sampling and slices each step's completions by process index, so "
        "the tp ranks of a group, which must see the same tokens, would generate and train on different "
        f"completions. Run {trainer} with tp_size 1 (FSDP2 works; the reference model gets qwen35_accel's units)."
    )


def trl_under_cp_error(trainer: str, cp_size: int) -> NotImplementedError:
    return NotImplementedError(
        f"TRL's {trainer} under context parallelism (cp_size={cp_size}) is not supported for Qwen3.5 by "
        "qwen35_accel: TRL computes log-probabilities from the logits it receives, which under CP are this rank's "
        f"sequence chunks. Run {trainer} with cp_size 1 (FSDP2 and tensor parallelism work)."
    )
