"""A failure on one rank ends the whole CPU launch promptly, with its traceback.

Real `accelerate launch` runs of the recipe on `cpu_fsdp2.yaml` (FSDP2 over gloo, the
plugin's exit teardown active), with a fault injected on rank 1. Without a bounded exit
teardown, the failing rank waited in a barrier while its peer sat in an FSDP2
collective, and the launch hung for gloo's timeout (30 minutes).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from qwen35_accel.testing.launch import RECIPE, accelerate_launch_command, describe, run_launch
from qwen35_accel.testing.processes import is_running

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch: each test launches worlds

FAULT_SCRIPT = Path(__file__).resolve().parent / "scripts" / "sft_with_fault.py"
ARGS = ["--per_device_train_batch_size", "2", "--logging_steps", "1", "--seed", "0"]
BOUND_S = 60.0  # from the exception to the end of every process of the launch
HUNG_S = 240.0  # a launch still running then is hung: killed, and the test fails


def _still_running(pids_file: Path) -> list[int]:
    return [int(pid) for pid in pids_file.read_text().split() if is_running(int(pid))]


def _faulty_launch(tmp_path: Path, fault_at: str, *args: str):
    stamp, pids = tmp_path / "fault_stamp", tmp_path / "pids"
    env = {"FAULT_RANK": "1", "FAULT_AT": fault_at, "FAULT_STAMP": str(stamp), "FAULT_PIDS": str(pids)}
    cmd = accelerate_launch_command("cpu_fsdp2.yaml", FAULT_SCRIPT, *ARGS, "--output_dir", str(tmp_path / "out"), *args)
    result = run_launch(cmd, timeout=HUNG_S, env=env)
    ended = time.time()
    return result, stamp, ended, pids


@pytest.mark.parametrize("fault_at", ["step:2", "exit"], ids=["at_step_2", "after_training"])
def test_an_exception_on_one_rank_ends_every_process_within_the_bound(tmp_path, fault_at):
    result, stamp, ended, pids = _faulty_launch(tmp_path, fault_at, "--max_steps", "4")
    assert result.returncode != 0, describe(result)
    assert "InjectedFault: injected fault on rank 1" in result.stderr, describe(result)
    assert stamp.exists(), describe(result)
    took = ended - float(stamp.read_text())
    assert took < BOUND_S, f"the launch ended {took:.1f} s after the fault\n{describe(result)}"
    assert not result.leftover_processes and not _still_running(pids), describe(result)


def test_a_corrupt_checkpoint_on_one_rank_ends_the_resumed_launch_within_the_bound(tmp_path):
    first = tmp_path / "first"
    started = time.time()
    result = run_launch(accelerate_launch_command(
        "cpu_fsdp2.yaml", RECIPE, *ARGS, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2",
        "--output_dir", str(first),
    ), timeout=HUNG_S)
    normal = time.time() - started
    assert result.returncode == 0, describe(result)
    checkpoint = first / "checkpoint-2"
    (checkpoint / "rng_state_1.pth").write_bytes(b"")  # read by rank 1 alone

    started = time.time()
    result = run_launch(accelerate_launch_command(
        "cpu_fsdp2.yaml", RECIPE, *ARGS, "--max_steps", "4", "--resume_from_checkpoint", str(checkpoint),
        "--output_dir", str(tmp_path / "resumed"),
    ), timeout=HUNG_S)
    took = time.time() - started
    assert result.returncode != 0, describe(result)
    assert "[rank1]" in result.stderr and "Traceback" in result.stderr, describe(result)
    # The load fails before the first step: the failing launch may take at most the bound
    # longer than a whole successful two-step launch.
    assert took < normal + BOUND_S, f"failed launch took {took:.1f} s, a normal one {normal:.1f} s\n{describe(result)}"
    assert not result.leftover_processes, describe(result)


def test_an_fsdp1_cpu_launch_of_qwen35_is_refused_on_every_rank_with_the_conversion(tmp_path):
    """`fsdp_version: 1` (Accelerate's default when a YAML names none) on CPU, an unchanged recipe: every rank
    raises the reason and the command that converts the YAML (before: the plugin made it FSDP on CPU and
    FSDP1 crashed on "Inconsistent compute device and device_id on rank 0: cpu vs cpu:0")."""
    from qwen35_accel.testing.launch import CONFIGS, assert_refused_on_every_rank

    config = tmp_path / "cpu_fsdp1.yaml"
    # As `accelerate config` writes an FSDP1 YAML (no parallelism_config), sync_module_states off: with it on,
    # Accelerate itself refuses FSDP1 on CPU before any model exists.
    yaml = (CONFIGS / "cpu_fsdp2.yaml").read_text()
    yaml = yaml[: yaml.index("parallelism_config:")].replace("fsdp_version: 2", "fsdp_version: 1\n  fsdp_sync_module_states: false")
    config.write_text(yaml)
    result = run_launch(accelerate_launch_command(config, RECIPE, *ARGS, "--max_steps", "1", "--output_dir", str(tmp_path / "out")))
    assert "an FSDP v1 config runs as DDP over gloo" in result.stderr, describe(result)
    assert_refused_on_every_rank(result, "ValueError", "qwen35_accel: Qwen3_5ForCausalLM under FSDP v1")
