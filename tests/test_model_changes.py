"""The registry of model changes (`qwen35_accel/model_changes.py`) against the sources: every kind of
change a module of the package makes to a model's modules (class swaps, forward hooks, state-dict hooks,
rebound methods) is listed, with the module that makes it, and the registry names no module that makes
none; `qwen35-accel env` prints it (issue 59)."""

from __future__ import annotations

import re
from pathlib import Path

from qwen35_accel.model_changes import CLASS_SWAP, HOOK, KINDS, MODEL_CHANGES, PRE_HOOK, REBIND, STATE_DICT_HOOK

PACKAGE = Path(__file__).resolve().parents[1] / "qwen35_accel"
SITES = {
    CLASS_SWAP: re.compile(r"\bswap_class\(\w|\.__class__ = "),
    PRE_HOOK: re.compile(r"\.register_forward_pre_hook\("),
    HOOK: re.compile(r"\.register_forward_hook\("),
    STATE_DICT_HOOK: re.compile(r"\.register_(state_dict_post|load_state_dict_pre)_hook\("),
    REBIND: re.compile(r"= types\.MethodType\(|\.loss_function = |__dict__\[HOLDER_NAME\] = "),
}


def _sites() -> set[tuple[str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "testing" or path.name == "model_changes.py":
            continue
        module = ".".join(relative.with_suffix("").parts)
        for line in path.read_text().splitlines():
            if line.lstrip().startswith(("#", "def ", '"""')):
                continue
            found.update((module, kind) for kind, pattern in SITES.items() if pattern.search(line))
    return found


def test_every_change_a_module_makes_is_registered_and_nothing_else():
    registered = {(change.where, change.kind) for change in MODEL_CHANGES}
    assert {change.kind for change in MODEL_CHANGES} <= set(KINDS)
    sites = _sites()
    assert not sites - registered, f"changes made but not in qwen35_accel/model_changes.py: {sorted(sites - registered)}"
    making = {module for module, _kind in sites}
    stale = {change.where for change in MODEL_CHANGES} - making
    assert not stale, f"registered modules that make no change: {sorted(stale)}"


def test_env_prints_the_registry(capsys):
    from qwen35_accel import cli

    report = cli.env()
    assert report["model_changes"] and len(report["model_changes"]) == len(MODEL_CHANGES)
    cli.print_env(report)
    out = capsys.readouterr().out
    assert "model changes" in out and "class swap on each GatedDeltaNet (every family) (model.fp32_gate)" in out
