"""Turning the plugin on and off: `install()`, `uninstall()`, `status()` over the patch points
the registry (`patches.py`) declares and hands over with `register` at its import.

A patch point wraps one attribute of Accelerate or the Trainer; its version guard names
the versions of the package whose internals the wrapper was written against. Points of
modules that are not imported yet (the Trainer's) are deferred: a later `install()`
patches them (`accelerator_init` calls it when an Accelerator is created, the
preparation again when it prepares a model, and `_DeferredWatcher` at the first import
after a deferred point's module has been imported: Transformers' `from_pretrained` runs
before any Accelerator). This module imports no wrapper, so the
wrappers can import `install` from it without an import cycle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import sys
from collections.abc import Callable
from typing import Any

from .notices import warn_once
from ..settings import PluginSettings

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


ACCELERATE = VersionGuard("accelerate", ">=1.15,<1.17")
TRANSFORMERS = VersionGuard("transformers", ">=5.24,<5.26")
TRL = VersionGuard("trl", ">=1.16,<1.17")
DEEPSPEED = VersionGuard("deepspeed", ">=0.19.8,<0.20")
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


_ORIGINAL = "__qwen35_accel_original__"
_installed: dict[PatchPoint, Callable[..., Any]] = {}
_points: list[PatchPoint] = []  # the registry's declarations (`register`)


def register(points: tuple[PatchPoint, ...]) -> None:
    """The patch points `install`, `uninstall` and `status` act on: the registry (`patches.py`)
    hands its declarations over at its import, so that nothing here imports a wrapper."""
    _points[:] = points


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
    if not _points:
        raise RuntimeError(
            "qwen35_accel: no patch points are registered; install through qwen35_accel.install() or "
            "qwen35_accel.integrations.plugin.install(), which import the registry first"
        )
    supported, version = ACCELERATE.check()
    if not supported:
        warn_once(
            f"qwen35_accel: accelerate {version} is outside the tested range {ACCELERATE.tested}; the Accelerate plugin "
            "is not active (stock Accelerate behaviour). PARALLELIZER.apply still works directly."
        )
        return False
    for point in _points:
        if point in _installed or _deferred(point):
            continue  # deferred: patched by a later install() once that module is fully imported
        if point.guard is not ACCELERATE:
            ok, found = point.guard.check()
            if not ok:
                warn_once(
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
    _watch_deferred()
    return True


class _DeferredWatcher:
    """A meta-path finder that finds nothing: at each import it looks whether a deferred point's
    module has been imported meanwhile (the import before this one completed it) and then runs
    `install()`; it removes itself once nothing is deferred. The look is a few `sys.modules`
    lookups, one per deferred module."""

    def __init__(self, modules: set[str]) -> None:
        self.modules = modules
        self._busy = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if self._busy or not any(name in sys.modules for name in self.modules):
            return None
        self._busy = True
        try:
            if any(_resolvable(p) for p in _points if p not in _installed and p.module in self.modules):
                install()
        finally:
            self._busy = False
        return None


def _watch_deferred() -> None:
    """Keep one `_DeferredWatcher` on the modules of the points still deferred (none: no watcher)."""
    deferred = {p.module for p in _points if p not in _installed and _deferred(p)}
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _DeferredWatcher)]
    if deferred:
        sys.meta_path.insert(0, _DeferredWatcher(deferred))


def uninstall() -> None:
    """Restore the originals (for tests and `QWEN35_ACCEL=0` comparisons)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _DeferredWatcher)]
    for point, original in list(_installed.items()):
        owner, name = _owner_and_name(point)
        setattr(owner, name, original)
        del _installed[point]


def status() -> dict[str, Any]:
    """Plugin state for `qwen35-accel env`: versions, activation, why not, each patch point."""
    supported, version = ACCELERATE.check()
    points = []
    for point in _points:
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


def accelerator_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Accelerator.__init__`: then apply the deferred patch points whose modules are imported
    by now (a Trainer subclass such as TRL's `DPOTrainer` prepares its reference model right
    after creating the accelerator, before any `prepare` call).

    Before the original runs, the one parallelism layout Accelerate refuses with advice that
    contradicts itself (replicate-only data parallelism with cp > 1, or tp > 1 before Accelerate
    1.16) is refused here with the layouts that work (`parallelism_layouts.replicate_only_refusal`). An error the original
    raises by itself is Accelerate's: it passes through this frame unchanged but for a note
    saying so (Python cannot drop a caller's frame from a traceback)."""
    from .notices import note_if_not_ours
    from .parallelism_layouts import replicate_only_refusal

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        refusal = replicate_only_refusal(kwargs.get("parallelism_config"))
        if refusal is not None:
            raise refusal
        try:
            original(self, *args, **kwargs)
        except Exception as error:
            note_if_not_ours(error, "Accelerate's own Accelerator.__init__")
            raise
        install()

    return wrapper
