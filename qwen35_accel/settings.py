"""The one configuration, `PluginSettings`: every `QWEN35_ACCEL_*` knob (the plugin's own and the
parallelizer's, `parallel`), with its default, help and choices.

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
from typing import Any

from .parallel.options import ParallelOptions, knob

ENV_PREFIX = "QWEN35_ACCEL"
_BOOLEAN = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    """The one configuration of qwen35_accel: every `QWEN35_ACCEL_*` knob with its default, help and
    choices (declared once, by `parallel.options.knob`), built once per preparation.

    Two branches: the plugin's own knobs (the fields below), and `parallel`, the `ParallelOptions`
    that `PARALLELIZER.apply` runs with: its knob fields are read from the environment like the
    plugin's own, the engine's config fills the others at preparation (`with_parallel`: policies,
    checkpointing, resharding, compile). Knob `x` is the variable `QWEN35_ACCEL_X` (upper case;
    `enabled` is `QWEN35_ACCEL`), whichever branch holds it (`knobs()` lists them, flattened).
    """

    enabled: bool = knob(True, "0 turns the automatic activation off: stock Accelerate behaviour")
    cpu_fsdp: bool = knob(
        True,
        "run an FSDP config on a machine without accelerators as FSDP2 over gloo, a DeepSpeed config as DeepSpeed "
        "over gloo (stock Accelerate silently runs N independent single-process trainings there, and DeepSpeed's "
        "batch-size check fails)",
    )
    cp_metrics_per_chunk: bool = knob(
        False,
        "under cp > 1, run the Trainer's preprocess_logits_for_metrics on each rank's sequence chunks and gather its "
        "output instead of the whole-sequence logits (exact only for position-wise functions such as argmax)",
    )
    rl_generation: str = knob(
        "replicated",
        "TRL's GRPO/RLOO generation on a dense Qwen3.5 model: replicated (TRL's sampling, one RNG stream per "
        "replica; under cp every rank of a group generates all of the group's rows) or split (per-row sampling: each "
        "row its own generator seeded from the seed, the step and the row's global index, in every run, one process "
        "included; under cp > 1 each cp rank generates 1/cp of its group's rows, gathered after; other completions "
        "than replicated's, the same with and without cp)",
        choices=("replicated", "split"),
    )
    fp32_gates: bool = knob(
        True,
        "without FSDP (one process, DDP): hold each GatedDeltaNet's A_log/dt_bias in an fp32 holder at prepare, "
        "the checkpoint's fp32 values read back after a bf16 load; 0 leaves them as loaded (FSDP2 always holds them "
        "in fp32)",
    )
    distributed_config: str = knob(
        "plugin",
        "Transformers' own sharding at load (from_pretrained(..., distributed_config=...)) of a Qwen3.5 model (dense or MoE): plugin "
        "shards data parallelism alone (fsdp/HSDP sizes) into the plugin's units, fp32 gates loaded from the "
        "checkpoint, and does what check does for other layouts; check refuses the loads that would train the gates "
        "bf16-rounded (a bf16 load or fsdp_mixed_precision under FSDP), naming the ways that train them in fp32, and "
        "leaves the rest to Transformers; stock leaves every load to Transformers",
        choices=("plugin", "check", "stock"),
    )
    exit_barrier_timeout: int = knob(
        60,
        "seconds a CPU (gloo) rank that finished normally waits at exit for its peers before leaving without "
        "tearing the group down; a rank that ends through an exception never waits",
    )
    ignore_versions: bool = knob(
        False, "1: an unsupported torch/transformers/accelerate version warns at import instead of raising"
    )
    triton_on_cpu: bool = knob(
        False,
        "for tests: with TRITON_INTERPRET=1, CPU tensors go to FLA's Triton kernels through Triton's interpreter "
        "(read by the kernel selection, ops/kernels.py: TRITON_ON_CPU_VARIABLE)",
    )
    parallel: ParallelOptions = dataclasses.field(default_factory=ParallelOptions)

    @staticmethod
    def env_name(knob_name: str) -> str:
        """The variable of the knob named `knob_name` (a field of either branch, or its declared `setting`)."""
        return ENV_PREFIX if knob_name == "enabled" else f"{ENV_PREFIX}_{knob_name.upper()}"

    def with_parallel(self, **choices: Any) -> PluginSettings:
        """This configuration with `parallel`'s fields in `choices` set (what the engine's config decides:
        policies, checkpointing, resharding, compile; TypeError for a name `ParallelOptions` lacks)."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, **choices))

    def knob_values(self) -> dict[str, object]:
        """{variable: value} of every knob, both branches (what `qwen35-accel env` prints and the ranks compare)."""
        return {k.variable: k.value(self) for k in knobs()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, strict: bool = False) -> PluginSettings:
        """The configuration `environ` (default `os.environ`) sets, both branches.

        An unknown `QWEN35_ACCEL_*` name raises ValueError with `strict` (where the plugin
        acts on a dense Qwen3.5 model, whose run it would silently configure otherwise than
        the user meant), and otherwise warns once per process (stock paths: every other
        model, `qwen35-accel env`).
        """
        environ = os.environ if environ is None else environ
        known = {k.variable: k for k in knobs()}
        unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX + "_") and k not in known)
        if unknown:
            message = f"unknown setting(s) {unknown}; qwen35_accel reads {sorted(known)}"
            if strict:
                raise ValueError(
                    f"{message}. A misspelt name would leave its setting at the default for this Qwen3.5 model: "
                    "correct or unset it"
                )
            _warn_unknown_once(unknown, message)
        values: dict[str, dict[str, object]] = {"plugin": {}, "parallel": {}}
        for name, k in known.items():
            raw = environ.get(name)
            if raw is not None and raw != "":
                values[k.branch][k.field.name] = _parse(name, k.field, raw)
        return cls(**values["plugin"], parallel=ParallelOptions(**values["parallel"]))


@dataclasses.dataclass(frozen=True)
class Knob:
    """One `QWEN35_ACCEL_*` knob: its variable, the branch of `PluginSettings` holding it ("plugin" or
    "parallel") and its declaring field (default, help and choices in `field.metadata`)."""

    variable: str
    branch: str
    field: dataclasses.Field

    def value(self, settings: PluginSettings) -> object:
        holder = settings.parallel if self.branch == "parallel" else settings
        return getattr(holder, self.field.name)


@functools.cache
def knobs() -> tuple[Knob, ...]:
    """Every knob, flattened: the plugin's own, then `ParallelOptions`' (its fields declared by `knob`;
    the variable named after `setting` where one is declared)."""
    own = [Knob(PluginSettings.env_name(f.name), "plugin", f) for f in dataclasses.fields(PluginSettings) if "help" in f.metadata]
    parallel = [
        Knob(PluginSettings.env_name(f.metadata["setting"] or f.name), "parallel", f)
        for f in dataclasses.fields(ParallelOptions) if "help" in f.metadata
    ]
    return (*own, *parallel)


def check_same_on_every_rank(settings: PluginSettings) -> None:
    """ValueError on every rank when the ranks read different settings (each reads its own
    environment: a variable set on one node's launcher only): most of them change which
    collectives run, and ranks that disagree would hang in mismatched ones. Collective over
    the default process group (a no-op without one)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    everyone: list[dict[str, object] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, settings.knob_values())
    differ = {
        variable: {rank: values[variable] for rank, values in enumerate(everyone)}
        for variable in settings.knob_values()
        if len({values[variable] for values in everyone}) > 1
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
    choices = field.metadata["choices"]
    if field.name in _FORMERLY_BOOLEAN and value in _BOOLEAN and value not in choices:
        return _FORMERLY_BOOLEAN[field.name][_BOOLEAN[value]]
    if choices is not None and value not in choices:
        raise ValueError(f"{env_name}={raw!r}: expected one of {list(choices)}")
    return value


def settings_table() -> list[dict[str, str]]:
    """Rows (variable, default, meaning) for docs/configuration.md and `qwen35-accel env`."""
    rows = []
    for k in knobs():
        default = str(k.field.default).lower() if isinstance(k.field.default, bool) else str(k.field.default)
        rows.append({"variable": k.variable, "default": default, "meaning": k.field.metadata["help"]})
    return rows
