"""`qwen35-accel env`: versions, plugin activation, patch points and settings of this process."""

from __future__ import annotations

import os
from typing import Any


def env() -> dict[str, Any]:
    """Versions, plugin activation and patch points (what `env --json` prints)."""
    import importlib.metadata as md
    import platform

    from . import __version__
    from ._versions import SUPPORTED, is_supported
    from .settings import PluginSettings, settings_table
    from .model_changes import model_changes_table

    versions = {}
    for dist_name in ("torch", "transformers", "accelerate"):
        try:
            versions[dist_name] = md.version(dist_name)
        except md.PackageNotFoundError:
            versions[dist_name] = None
    entry_points = [ep.value for ep in md.entry_points(group="torch.backends") if ep.name == "qwen35_accel"]
    try:
        settings: dict[str, Any] | str = PluginSettings.from_env().knob_values()
    except ValueError as exc:
        settings = f"invalid: {exc}"
    import accelerate  # noqa: F401  (the autoload patches on this import)

    from .integrations.plugin import status

    return {
        "kernels": kernels_report(),
        "qwen35_accel": __version__,
        "python": platform.python_version(),
        "versions": versions,
        "supported": {name: f">={lo},<{hi}" for name, (lo, hi, _why) in SUPPORTED.items()},
        "versions_ok": {name: version is not None and is_supported(name, version) for name, version in versions.items()},
        "autoload_entry_point": entry_points[0] if entry_points else None,
        "QWEN35_ACCEL": os.environ.get("QWEN35_ACCEL", "(unset: on)"),
        "settings": settings,
        "settings_reference": settings_table(),
        "plugin": status(),
        "model_changes": model_changes_table(),
    }


def kernels_report() -> dict[str, Any]:
    """Which GatedDeltaNet kernels a run here takes: per optional package, what was found
    (version, usable or why not, whether Transformers calls it) and the summary lines."""
    import torch

    from .ops import kernels

    cuda = torch.cuda.is_available()
    packages = {}
    for package in ("fla", "causal_conv1d", "fla_conv"):
        found = kernels.status(package)
        packages[package] = {
            "distribution": found.distribution,
            "version": found.version,
            "usable": found.usable,
            "reason": found.reason,
            "transformers_calls_it": kernels.transformers_uses(package) if package in kernels.TRANSFORMERS_FUNCTIONS else False,
        }
    return {"device": "cuda" if cuda else "cpu", "summary": kernels.describe(cuda), "packages": packages}


def print_env(e: dict[str, Any]) -> None:
    """The report as `qwen35-accel env` prints it."""
    print(f"qwen35_accel {e['qwen35_accel']} (python {e['python']})")
    for name, version in e["versions"].items():
        verdict = "ok" if e["versions_ok"][name] else "UNSUPPORTED"
        print(f"  {name:<13} {version or 'not installed':<12} {verdict:<11} (supported {e['supported'].get(name, '?')})")
    plugin = e["plugin"]
    state = "active" if plugin["active"] else f"NOT ACTIVE: {plugin['why_not_active']}"
    print(f"plugin: {state}")
    print(f"  accelerate {plugin['accelerate']} (patch points tested with {plugin['tested_accelerate']})")
    print(f"  autoload entry point: {e['autoload_entry_point'] or 'missing (reinstall the package)'}; QWEN35_ACCEL={e['QWEN35_ACCEL']}")
    print("patch points:")
    for point in plugin["patch_points"]:
        mark = "x" if point["active"] else ("~" if point["deferred"] else " ")
        print(f"  [{mark}] {point['target']}: {point['purpose']}")
    print("  ([~]: patched once that module is imported)")
    print("model changes (on prepared models' modules, besides the patch points):")
    for change in e["model_changes"]:
        print(f"  {change['kind']} on {change['on']} ({change['where']}): {change['why']}")
    print(f"kernels ({e['kernels']['device']}):")
    for line in e["kernels"]["summary"]:
        print(f"  {line}")
    print("settings:")
    for row in e["settings_reference"]:
        print(f"  {row['variable']} (default {row['default']}): {row['meaning']}")
