"""The plugin's patch points: one registry, each point with its target, guard and wrapper.

Each patch point wraps one attribute of Accelerate or the Trainer and calls the original
for anything that is not a dense Qwen3.5 model. `install()` applies them (idempotent);
`uninstall()` restores the originals; `status()` reports what is active and why not.
Points of modules that are not imported yet (the Trainer's) are deferred: a later
`install()` (the plugin calls it again when it prepares a model) patches them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import sys
import warnings
from collections.abc import Callable
from typing import Any

from . import checkpoints, cpu_backend, evaluation, preparation, several_models, step_hooks
from .settings import PluginSettings

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


@dataclasses.dataclass(frozen=True)
class VersionGuard:
    """The versions of `package` whose internals a patch point was written against and tested with."""

    package: str
    tested: str  # a PEP 440 specifier set

    def check(self) -> tuple[bool, str | None]:
        """(whether the installed version is in `tested`, the installed version or None)."""
        from packaging.specifiers import SpecifierSet

        try:
            version = importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return False, None
        if self.package == "accelerate":  # what the running process imported
            with contextlib.suppress(ImportError):
                import accelerate

                version = accelerate.__version__
        return SpecifierSet(self.tested).contains(version, prereleases=True), version


ACCELERATE = VersionGuard("accelerate", ">=1.15,<1.16")
TRANSFORMERS = VersionGuard("transformers", ">=5.24,<5.25")
TRL = VersionGuard("trl", ">=1.16,<1.17")
# The tested ranges, as `qwen35-accel env` and the README show them.
TESTED_ACCELERATE, TESTED_TRANSFORMERS = ACCELERATE.tested, TRANSFORMERS.tested


@dataclasses.dataclass(frozen=True)
class PatchPoint:
    module: str
    attribute: str  # "Class.method" or a module-level name
    wrap: Wrap = dataclasses.field(compare=False, repr=False)
    guard: VersionGuard
    purpose: str

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"


PATCH_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(
        "accelerate.state", "PartialState._prepare_backend", cpu_backend.prepare_backend, ACCELERATE,
        "no accelerator, WORLD_SIZE > 1 and an FSDP config: gloo backend, MULTI_CPU (stock: DistributedType.NO)",
    ),
    PatchPoint(
        "accelerate.state", "AcceleratorState.__init__", cpu_backend.accelerator_state_init, ACCELERATE,
        "then MULTI_CPU with an FSDP plugin becomes DistributedType.FSDP (stock ignores the plugin on CPU)",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.__init__", several_models.accelerator_init, ACCELERATE,
        "every model: then the deferred points whose modules are imported by now (a Trainer subclass may prepare a "
        "reference model before any prepare call)",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.prepare", several_models.prepare, ACCELERATE,
        "several dense Qwen3.5 models under FSDP2: those no optimizer holds (a frozen reference) get our units too "
        "(stock: 'Only one model is supported when using FSDP2')",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator._prepare_tp", preparation.prepare_tp, ACCELERATE,
        "dense Qwen3.5: Accelerate's load-time TP path is skipped; the parallelizer splits the model by heads",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator._prepare_cp", preparation.prepare_cp, ACCELERATE,
        "dense Qwen3.5: no torch ring-attention hooks; the step's CP context becomes ours",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator._prepare_fsdp2", preparation.prepare_fsdp2, ACCELERATE,
        "dense Qwen3.5: fp32 gate holders installed before Accelerate records parameter names",
    ),
    PatchPoint(
        "accelerate.accelerator", "fsdp2_apply_ac", preparation.fsdp2_apply_ac, ACCELERATE,
        "dense Qwen3.5: skipped; the parallelizer checkpoints each decoder layer",
    ),
    PatchPoint(
        "accelerate.accelerator", "fsdp2_prepare_model", preparation.fsdp2_prepare_model, ACCELERATE,
        "dense Qwen3.5: PARALLELIZER.apply with the FSDP plugin's settings and the accelerator's mesh",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.maybe_context_parallel", step_hooks.maybe_context_parallel, ACCELERATE,
        "dense Qwen3.5 under cp > 1: shards the step's buffers with qwen35_accel's layout",
    ),
    PatchPoint(
        "accelerate.accelerator", "Accelerator.clip_grad_norm_", step_hooks.clip_grad_norm, ACCELERATE,
        "dense Qwen3.5 under tp > 1: the norm of the whole gradient (split parameters summed over the tp group)",
    ),
    PatchPoint(
        "accelerate.accelerator", "load_fsdp_model", checkpoints.load_fsdp_model, ACCELERATE,
        "dense Qwen3.5 under tp > 1 with FULL_STATE_DICT (Accelerator.load_state): rank 0's file broadcast into the "
        "per-head slices (torch's full-state-dict loading copies full tensors into them)",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer._load_from_checkpoint", checkpoints.trainer_load_from_checkpoint, TRANSFORMERS,
        "dense Qwen3.5 under tp > 1 with FULL_STATE_DICT (resume_from_checkpoint): as load_fsdp_model above (the "
        "Trainer holds its own reference to Accelerate's function)",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer._prepare_context_parallel_inputs", step_hooks.prepare_context_parallel_inputs,
        TRANSFORMERS,
        "dense Qwen3.5 under cp > 1: the batch is right-padded to a multiple of 2*cp first (padding-free collators "
        "make rows of any length; stock leaves that to the collator); TRL's log-probability trainers refused under "
        "cp, its sampling trainers under tp",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer.evaluation_loop", evaluation.evaluation_loop, TRANSFORMERS,
        "dense Qwen3.5 under cp or tp > 1: the loop's gather_function gathers over the data-parallel ranks only (ranks "
        "differing in cp/tp hold the same batch; stock returns each row cp*tp times), every other gather_for_metrics "
        "stays stock; under cp > 1 TRL SFTTrainer's loss-only prediction_step runs inside the CP context; with "
        "QWEN35_ACCEL_CP_METRICS_PER_CHUNK=1: preprocess_logits_for_metrics runs on "
        "each rank's chunks (in prediction_step), not on the assembled logits",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer.prediction_step", evaluation.prediction_step, TRANSFORMERS,
        "dense Qwen3.5 under cp > 1 or a vocab-parallel lm_head: the logits of the whole sequence and vocab (stock: "
        "this rank's chunks); label-less batches run inside the CP context",
    ),
    PatchPoint(
        "transformers.trainer", "Trainer.save_model", checkpoints.trainer_save_model, TRANSFORMERS,
        "dense Qwen3.5 under FSDP2 with a sharded state dict type: the explicit save_model writes a Hugging Face "
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
)

_ORIGINAL = "__qwen35_accel_original__"
_installed: dict[PatchPoint, Callable[..., Any]] = {}
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def accelerate_version_supported() -> tuple[bool, str | None]:
    """(whether the installed Accelerate is in the plugin's tested range, its version)."""
    return ACCELERATE.check()


def _owner_and_name(point: PatchPoint) -> tuple[Any, str]:
    owner: Any = importlib.import_module(point.module)
    *path, name = point.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _resolvable(point: PatchPoint) -> bool:
    """Whether the point's module is imported and its target already defined (a module
    that is still being imported, e.g. transformers.trainer importing Accelerate, is not)."""
    owner: Any = sys.modules.get(point.module)
    for part in point.attribute.split("."):
        if owner is None or not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return True


def _deferred(point: PatchPoint) -> bool:
    return point.guard is not ACCELERATE and not _resolvable(point)


def _current(point: PatchPoint) -> Any:
    owner, name = _owner_and_name(point)
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def install() -> bool:
    """Apply every patch point (idempotent). Returns False, with one warning, when the
    installed Accelerate is outside its tested range (stock behaviour then); a point
    whose own guard fails (the Trainer's, outside the tested Transformers) is skipped
    with a warning."""
    supported, version = ACCELERATE.check()
    if not supported:
        _warn_once(
            f"qwen35_accel: accelerate {version} is outside the tested range {ACCELERATE.tested}; the Accelerate plugin "
            "is not active (stock Accelerate behaviour). PARALLELIZER.apply still works directly."
        )
        return False
    for point in PATCH_POINTS:
        if point in _installed or _deferred(point):
            continue  # deferred: patched by a later install() once that module is fully imported
        if point.guard is not ACCELERATE:
            ok, found = point.guard.check()
            if not ok:
                _warn_once(
                    f"qwen35_accel: {point.guard.package} {found} is outside the tested range {point.guard.tested}; "
                    f"{point.target} is left unpatched."
                )
                continue
        owner, name = _owner_and_name(point)
        original = _current(point)
        if getattr(original, _ORIGINAL, None) is not None:  # patched by another copy of this module
            _installed[point] = getattr(original, _ORIGINAL)
            continue
        wrapper = point.wrap(original)
        setattr(wrapper, _ORIGINAL, original)
        setattr(owner, name, wrapper)
        _installed[point] = original
    return True


def uninstall() -> None:
    """Restore the originals (for tests and `QWEN35_ACCEL=0` comparisons)."""
    for point, original in list(_installed.items()):
        owner, name = _owner_and_name(point)
        setattr(owner, name, original)
        del _installed[point]


def status() -> dict[str, Any]:
    """Plugin state for `qwen35-accel env`: versions, activation, why not, each patch point."""
    supported, version = ACCELERATE.check()
    points = []
    for point in PATCH_POINTS:
        active = False
        deferred = _deferred(point)
        if version is not None and not deferred:  # status never imports anything
            with contextlib.suppress(Exception):
                active = getattr(_current(point), _ORIGINAL, None) is not None
        points.append({"target": point.target, "active": active, "deferred": deferred, "purpose": point.purpose})
    active = any(p["active"] for p in points)
    return {
        "accelerate": version,
        "tested_accelerate": ACCELERATE.tested,
        "supported": supported,
        "active": active,
        "why_not_active": None if active else _why_not_active(version, supported),
        "tested_transformers": TRANSFORMERS.tested,
        "patch_points": points,
    }


def _why_not_active(version: str | None, supported: bool) -> str:
    if version is None:
        return "accelerate is not installed"
    if not supported:
        return (
            f"accelerate {version} is outside the plugin's tested range {ACCELERATE.tested}: stock Accelerate behaviour "
            f"(install accelerate{ACCELERATE.tested}; PARALLELIZER.apply works without the plugin)"
        )
    try:
        enabled = PluginSettings.from_env().enabled
    except ValueError as error:
        return f"invalid settings: {error}"
    if not enabled:
        return "QWEN35_ACCEL=0 turns the automatic activation off (qwen35_accel.install() activates it explicitly)"
    return "not activated in this process (the torch entry point activates it once accelerate is imported)"
