"""`accelerate launch` of a script as a user would run it, with a hard timeout (tests, benchmarks)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from ..local_world import free_port
from .processes import run_process_tree

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "sft.py"
CONFIGS = REPO / "accelerate_configs"
LAUNCH_TIMEOUT_S = 600.0


def launch_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment for a CPU launch: offline, one thread per rank, plugin on."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("QWEN35_ACCEL", None)
    env.update(extra or {})
    return env


def accelerate_launch_command(config: str | os.PathLike[str], script: str | os.PathLike[str], *args: str) -> list[str]:
    """`python -m accelerate.commands.launch --config_file CONFIG --main_process_port P SCRIPT ARGS`.

    A bare config name is looked up in `accelerate_configs/`.
    """
    path = Path(config)
    if not path.is_absolute() and not path.exists():
        path = CONFIGS / path
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path),
        "--main_process_port", str(free_port()), str(script), *args,
    ]


def run_launch(
    command: list[str], *, timeout: float = LAUNCH_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a launch (or a single process) from the repository root; the whole process tree is
    killed after `timeout` seconds (`ProcessTreeTimeout`, with the output)."""
    return run_process_tree(command, timeout=timeout, env=launch_env(env), cwd=REPO)


def run_to_completion(command: list[str], env: Mapping[str, str] | None = None) -> str:
    """`run_launch`, asserting it exited 0 and left no rank behind; returns stdout and stderr together."""
    result = run_launch(command, env=env)
    assert result.returncode == 0, describe(result)
    assert not getattr(result, "leftover_processes", False), f"ranks outlived the launcher\n{describe(result)}"
    return result.stdout + result.stderr


def describe(result: subprocess.CompletedProcess[str]) -> str:
    """Exit code and output tails, for assertion messages."""
    return (
        f"exit {result.returncode}: {' '.join(map(str, result.args))}\n--- stdout tail ---\n{result.stdout[-3000:]}\n"
        f"--- stderr tail ---\n{result.stderr[-5000:]}"
    )


def assert_refused_on_every_rank(result: subprocess.CompletedProcess[str], kind: str, message_start: str) -> None:
    """The launch failed, left no process behind, and every rank's error report is `kind` with a
    message starting `message_start` (the launcher may stop ranks before they print, so at
    least one report)."""
    import re

    assert result.returncode != 0 and not getattr(result, "leftover_processes", False), describe(result)
    reports = re.findall(r"\[rank\d\]: (\w+(?:Error|Exception)): (.*)", result.stderr)
    assert reports and all(k == kind and text.startswith(message_start) for k, text in reports), describe(result)
