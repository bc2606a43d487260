"""Plugin knobs: `QWEN35_ACCEL_*` environment variables, their defaults in one place.

Accelerate's YAML has no room for plugin settings, so the plugin reads these variables
(set them in the shell, or in the launcher's environment). Invalid values raise
ValueError naming the variable and the valid values. An unknown `QWEN35_ACCEL_*` name
(a misspelt knob) warns once per process; it raises only where the plugin acts on a
dense Qwen3.5 model (`from_env(strict=True)`), so it never stops another model's run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Mapping

ENV_PREFIX = "QWEN35_ACCEL"
def _knob(default: object, help: str) -> dataclasses.Field:
    return dataclasses.field(default=default, metadata={"help": help})


def _option(name: str) -> dataclasses.Field:
    """The knob of `ParallelOptions.name`: its default and help as `ParallelOptions` declares them
    (declared once, there; `ParallelOptions.from_settings` reads it back by the declared setting name)."""
    from .parallel.options import ParallelOptions

    field = ParallelOptions.__dataclass_fields__[name]
    return dataclasses.field(default=field.default, metadata={"help": field.metadata["help"]})


_BOOLEAN = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    """Every knob of the Accelerate plugin, with its default.

    Field `x` is read from `QWEN35_ACCEL_X` (upper case); `enabled` from `QWEN35_ACCEL`.
    """

    enabled: bool = _knob(True, "0 turns the automatic activation off: stock Accelerate behaviour")
    cpu_fsdp: bool = _knob(
        True,
        "run an FSDP config on a machine without accelerators as FSDP2 over gloo, a DeepSpeed config as DeepSpeed "
        "over gloo (stock Accelerate silently runs N independent single-process trainings there, and DeepSpeed's "
        "batch-size check fails)",
    )
    frozen_multimodal_sharding: str = _option("frozen_multimodal_sharding")
    fp32_holder_units: str = _option("fp32_holder_units")
    vocab_parallel_lm_head: bool = _option("vocab_parallel_lm_head")
    tiled_loss: str = _option("tiled_loss")
    cp_state_exchange: str = _option("cp_state_exchange")
    cp_metrics_per_chunk: bool = _knob(
        False,
        "under cp > 1, run the Trainer's preprocess_logits_for_metrics on each rank's sequence chunks and gather its "
        "output instead of the whole-sequence logits (exact only for position-wise functions such as argmax)",
    )
    rl_generation: str = _knob(
        "replicated",
        "TRL's GRPO/RLOO generation on a dense Qwen3.5 model: replicated (TRL's sampling, one RNG stream per "
        "replica; under cp every rank of a group generates all of the group's rows) or split (per-row sampling: each "
        "row its own generator seeded from the seed, the step and the row's global index, in every run, one process "
        "included; under cp > 1 each cp rank generates 1/cp of its group's rows, gathered after; other completions "
        "than replicated's, the same with and without cp)",
    )
    moe_balance: str = _option("moe_balance")
    ep: int = _option("ep")
    fp32_gates: bool = _knob(
        True,
        "without FSDP (one process, DDP): hold each GatedDeltaNet's A_log/dt_bias in an fp32 holder at prepare, "
        "the checkpoint's fp32 values read back after a bf16 load; 0 leaves them as loaded (FSDP2 always holds them "
        "in fp32)",
    )
    distributed_config: str = _knob(
        "plugin",
        "Transformers' own sharding at load (from_pretrained(..., distributed_config=...)) of a Qwen3.5 model (dense or MoE): plugin "
        "shards data parallelism alone (fsdp/HSDP sizes) into the plugin's units, fp32 gates loaded from the "
        "checkpoint, and does what check does for other layouts; check refuses the loads that would train the gates "
        "bf16-rounded (a bf16 load or fsdp_mixed_precision under FSDP), naming the ways that train them in fp32, and "
        "leaves the rest to Transformers; stock leaves every load to Transformers",
    )
    fsdp2_prefetch: bool = _option("enable_fsdp2_prefetch")
    fsdp2_forward_prefetch_depth: int = _option("fsdp2_forward_prefetch_depth")
    fsdp2_backward_prefetch_depth: int = _option("fsdp2_backward_prefetch_depth")
    exit_barrier_timeout: int = _knob(
        60,
        "seconds a CPU (gloo) rank that finished normally waits at exit for its peers before leaving without "
        "tearing the group down; a rank that ends through an exception never waits",
    )
    ignore_versions: bool = _knob(
        False, "1: an unsupported torch/transformers/accelerate version warns at import instead of raising"
    )
    triton_on_cpu: bool = _knob(
        False,
        "for tests: with TRITON_INTERPRET=1, CPU tensors go to FLA's Triton kernels through Triton's interpreter "
        "(read by the kernel selection, ops/kernels.py: TRITON_ON_CPU_VARIABLE)",
    )

    @staticmethod
    def env_name(field: str) -> str:
        return ENV_PREFIX if field == "enabled" else f"{ENV_PREFIX}_{field.upper()}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, strict: bool = False) -> PluginSettings:
        """Settings from `environ` (default `os.environ`).

        An unknown `QWEN35_ACCEL_*` name raises ValueError with `strict` (where the plugin
        acts on a dense Qwen3.5 model, whose run it would silently configure otherwise than
        the user meant), and otherwise warns once per process (stock paths: every other
        model, `qwen35-accel env`).
        """
        environ = os.environ if environ is None else environ
        known = {cls.env_name(f.name): f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX + "_") and k not in known)
        if unknown:
            message = f"unknown setting(s) {unknown}; qwen35_accel reads {sorted(known)}"
            if strict:
                raise ValueError(
                    f"{message}. A misspelt name would leave its setting at the default for this Qwen3.5 model: "
                    "correct or unset it"
                )
            _warn_unknown_once(unknown, message)
        values = {}
        for name, field in known.items():
            raw = environ.get(name)
            if raw is None or raw == "":
                continue
            values[field.name] = _parse(name, field, raw)
        return cls(**values)


def check_same_on_every_rank(settings: PluginSettings) -> None:
    """ValueError on every rank when the ranks read different settings (each reads its own
    environment: a variable set on one node's launcher only): most of them change which
    collectives run, and ranks that disagree would hang in mismatched ones. Collective over
    the default process group (a no-op without one)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    everyone: list[PluginSettings | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, settings)
    differ = {
        PluginSettings.env_name(f.name): {rank: getattr(s, f.name) for rank, s in enumerate(everyone)}
        for f in dataclasses.fields(PluginSettings)
        if len({getattr(s, f.name) for s in everyone}) > 1
    }
    if differ:
        raise ValueError(
            f"the ranks read different qwen35_accel settings: {differ} (value per global rank). Set the same "
            "QWEN35_ACCEL_* variables for every process (each node's launcher environment)."
        )


_warned_unknown: set[tuple[str, ...]] = set()


def _warn_unknown_once(unknown: list[str], message: str) -> None:
    if tuple(unknown) not in _warned_unknown:
        _warned_unknown.add(tuple(unknown))
        warnings.warn(
            f"qwen35_accel: {message}. Ignored here; a dense Qwen3.5 model prepared by the plugin refuses them.",
            stacklevel=3,
        )


# The choices of the knobs that only the plugin reads; those `PARALLELIZER.apply` takes as well are
# declared once, beside the code that acts on them (`_choices`).
_PLUGIN_CHOICES = {
    "rl_generation": ("replicated", "split"),
    "distributed_config": ("plugin", "check", "stock"),
}


@functools.cache
def _choices() -> dict[str, tuple[str, ...]]:
    """Every choice knob's choices: the plugin's own, and the parallelizer's from their declarations."""
    from .parallel.context_parallel.state_exchange import EXCHANGES
    from .parallel.expert_parallel.router import BALANCE_CHOICES
    from .parallel.options import FP32_HOLDER_UNITS_CHOICES, FROZEN_MULTIMODAL_SHARDING_CHOICES
    from .parallel.tiled_loss import TILED_LOSS_CHOICES

    return {
        "frozen_multimodal_sharding": FROZEN_MULTIMODAL_SHARDING_CHOICES,
        "fp32_holder_units": FP32_HOLDER_UNITS_CHOICES,
        "cp_state_exchange": EXCHANGES,
        "tiled_loss": TILED_LOSS_CHOICES,
        "moe_balance": BALANCE_CHOICES,
        **_PLUGIN_CHOICES,
    }
# Choice knobs that were booleans: their boolean spellings still work (true: the first choice after "off").
_FORMERLY_BOOLEAN = {"tiled_loss": {True: "recompute", False: "off"}}


def _parse(env_name: str, field: dataclasses.Field, raw: str) -> object:
    value = raw.strip().lower()
    if field.type in ("bool", bool):
        if value not in _BOOLEAN:
            raise ValueError(f"{env_name}={raw!r}: expected one of {sorted(_BOOLEAN)}")
        return _BOOLEAN[value]
    if field.type in ("int", int):
        try:
            number = int(value)
        except ValueError:
            number = -1
        if number < 0:
            raise ValueError(f"{env_name}={raw!r}: expected a non-negative integer")
        return number
    if field.name in _FORMERLY_BOOLEAN and value in _BOOLEAN and value not in _choices()[field.name]:
        return _FORMERLY_BOOLEAN[field.name][_BOOLEAN[value]]
    choices = _choices().get(field.name)
    if choices is not None and value not in choices:
        raise ValueError(f"{env_name}={raw!r}: expected one of {list(choices)}")
    return value


def settings_table() -> list[dict[str, str]]:
    """Rows (variable, default, meaning) for docs/configuration.md and `qwen35-accel env`."""
    rows = []
    for field in dataclasses.fields(PluginSettings):
        default = str(field.default).lower() if isinstance(field.default, bool) else str(field.default)
        rows.append({"variable": PluginSettings.env_name(field.name), "default": default, "meaning": field.metadata["help"]})
    return rows
