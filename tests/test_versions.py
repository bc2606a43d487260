"""The import-time version check names every unsupported version."""

from __future__ import annotations

from importlib import metadata

import pytest

from qwen35_accel import _versions


def test_release_parsing_drops_local_and_pre_release_tags():
    assert _versions._release("2.13.0+cpu") == (2, 13, 0)
    assert _versions._release("5.24.0.dev0") == (5, 24, 0)
    assert _versions._release("2.14.0rc1") == (2, 14, 0)


def test_installed_versions_are_supported():
    found = _versions.check_versions()
    assert set(found) >= {"torch", "transformers"}


def test_unsupported_versions_raise_import_error_naming_each(monkeypatch):
    fake = {"torch": "2.10.0", "transformers": "4.57.0", "accelerate": "1.15.0"}
    monkeypatch.setattr(_versions.metadata, "version", lambda name: fake[name])
    with pytest.raises(ImportError) as err:
        _versions.check_versions()
    message = str(err.value)
    assert "torch 2.10.0 is installed; qwen35-accel supports torch>=2.11,<2.16" in message
    assert "transformers 4.57.0 is installed; qwen35-accel supports transformers>=5.24,<5.26" in message
    assert "accelerate" not in message.split("Install a supported set")[0]


def test_missing_required_package_is_reported(monkeypatch):
    def version(name):
        if name == "transformers":
            raise metadata.PackageNotFoundError(name)
        return {"torch": "2.13.0", "accelerate": "1.15.0"}[name]

    monkeypatch.setattr(_versions.metadata, "version", version)
    with pytest.raises(ImportError, match="transformers is not installed"):
        _versions.check_versions()


def test_ignore_versions_turns_the_error_into_a_warning(monkeypatch):
    monkeypatch.setattr(_versions.metadata, "version", lambda name: {"torch": "2.10.0"}.get(name, "5.24.0"))
    monkeypatch.setenv("QWEN35_ACCEL_IGNORE_VERSIONS", "1")
    with pytest.warns(UserWarning, match="torch 2.10.0 is installed"):
        assert _versions.check_versions()["torch"] == "2.10.0"


def test_an_unsupported_accelerate_does_not_stop_the_import(monkeypatch):
    """Only the plugin needs Accelerate; it checks its own version and stays off outside it."""
    monkeypatch.setattr(_versions.metadata, "version", lambda name: {"accelerate": "1.14.0", "torch": "2.13.0"}.get(name, "5.24.0"))
    assert _versions.check_versions()["accelerate"] == "1.14.0"
    assert not _versions.is_supported("accelerate", "1.14.0") and _versions.is_supported("accelerate", "1.15.2")


def _pyproject_requirements(section: str) -> dict[str, str]:
    """{name: specifier} of pyproject.toml's `dependencies` or of one optional extra."""
    import pathlib

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())["project"]
    listed = project["dependencies"] if section == "dependencies" else project["optional-dependencies"][section]
    return {req.name: str(req.specifier) for req in map(Requirement, listed)}


def test_the_dependency_ranges_are_the_import_check_and_the_plugins_guards():
    """`pip install qwen35-accel` must resolve to versions where the import check passes and the
    plugin is active: the ranges are written three times (pyproject.toml, `_versions.SUPPORTED`,
    the plugin's guards in activation.py) and must agree, both ends."""
    from packaging.specifiers import SpecifierSet

    from qwen35_accel.integrations.activation import ACCELERATE, TRANSFORMERS

    dependencies = _pyproject_requirements("dependencies")
    for name, (lo, hi, _why) in _versions.SUPPORTED.items():
        assert SpecifierSet(dependencies[name]) == SpecifierSet(f">={lo},<{hi}"), (name, dependencies[name], lo, hi)
    for guard in (ACCELERATE, TRANSFORMERS):
        assert SpecifierSet(dependencies[guard.package]) == SpecifierSet(guard.tested), (guard.package, guard.tested)


def test_the_test_extra_pins_trl_to_the_plugins_tested_range():
    """The TRL patch points are guarded to one minor; the suite must install that one."""
    from packaging.specifiers import SpecifierSet

    from qwen35_accel.integrations.activation import TRL

    pins = _pyproject_requirements("test")
    assert SpecifierSet(pins["trl"]) == SpecifierSet(TRL.tested), pins.get("trl")
    assert "accelerate" not in pins and "transformers" not in pins  # the dependencies' ranges already are the guards
