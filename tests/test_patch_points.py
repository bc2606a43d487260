"""The patch-point table in docs/plugin.md is the registry's, row for row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qwen35_accel.integrations.patches import PATCH_POINTS

PLUGIN_PAGE = Path(__file__).resolve().parents[1] / "docs" / "plugin.md"


def _documented_targets() -> list[str]:
    text = PLUGIN_PAGE.read_text()
    table = text[text.index("| target | for a dense Qwen3.5 model |"):]
    table = table[: table.index("\n\n")]
    return re.findall(r"^\| `([^`]+)` \|", table, flags=re.MULTILINE)


def test_plugin_page_lists_every_patch_point_and_no_other():
    assert _documented_targets() == [point.target for point in PATCH_POINTS]


def test_every_patch_point_declares_a_guard_and_a_wrapper_of_its_own():
    assert len({point.target for point in PATCH_POINTS}) == len(PATCH_POINTS)
    for point in PATCH_POINTS:
        assert point.guard.package == point.module.split(".")[0], point.target
        assert callable(point.wrap) and point.purpose, point.target


def test_each_patch_point_lives_with_its_upstream():
    """Each upstream's folder declares its own points, and their wrappers live in that folder: a TRL
    release touches `integrations/trl/` alone."""
    from qwen35_accel.integrations.accelerate.accelerate_points import ACCELERATE_POINTS
    from qwen35_accel.integrations.transformers.trainer_points import TRANSFORMERS_POINTS
    from qwen35_accel.integrations.deepspeed.deepspeed_points import DEEPSPEED_POINTS
    from qwen35_accel.integrations.trl.trl_points import TRL_POINTS

    assert PATCH_POINTS == (*ACCELERATE_POINTS, *TRANSFORMERS_POINTS, *TRL_POINTS, *DEEPSPEED_POINTS)
    for folder, points in (("accelerate", ACCELERATE_POINTS), ("transformers", TRANSFORMERS_POINTS), ("trl", TRL_POINTS),
                           ("deepspeed", DEEPSPEED_POINTS)):
        assert points and {point.guard.package for point in points} == {folder}, folder
        for point in points:
            home = point.wrap.__module__
            # `Accelerator.__init__` runs the plugin's own activation (the deferred points) around Accelerate's.
            if point.target != "accelerate.accelerator.Accelerator.__init__":
                assert home.startswith(f"qwen35_accel.integrations.{folder}."), (point.target, home)


def test_install_refuses_to_run_without_the_registry_and_says_how(monkeypatch):
    """`activation` imports no wrapper: the registry hands it the points. Without them,
    install() would silently patch nothing."""
    from qwen35_accel.integrations import activation

    assert activation._points == list(PATCH_POINTS)  # handed over at the registry's import
    monkeypatch.setattr(activation, "_points", [])
    with pytest.raises(RuntimeError, match=r"no patch points are registered; install through qwen35_accel.install\(\)"):
        activation.install()


@pytest.mark.parametrize("sizes,why_not", [
    ({"fsdp_size": 2}, None),
    ({"fsdp_size": 2, "dp_replicate_size": 2}, None),
    ({"tp_size": 2}, "tp 2"),
    ({"fsdp_size": 2, "tp_size": 2}, "tp 2"),
    ({"fsdp_size": 2, "fsdp_plan": {"model.layers.*": "free_full_weight"}}, "an fsdp_plan of the user's"),
], ids=["fsdp2", "hsdp", "tp2", "fsdp2xtp2", "users-fsdp-plan"])
def test_transformers_sharding_takes_over_data_parallelism_alone(sizes, why_not):
    """`maybe_distribute_model`'s decision (read from the configuration only, the same on every rank):
    the plugin shards FSDP2/HSDP at load; any other layout, or a plan of the user's, stays Transformers'
    (tests/test_transformers_sharding.py runs both under torchrun)."""
    from transformers.distributed import DistributedConfig

    from qwen35_accel.integrations.transformers.load_sharding import plugin_shards

    assert plugin_shards(DistributedConfig(**sizes)) == why_not
