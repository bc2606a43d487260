"""Script runs batched into one launch per Accelerate config (and one process for the runs
without a launcher): the interpreter start and the imports of torch, Transformers, TRL and
Accelerate (10-20 s per process on a 2-core machine) are paid once per config, not per run.

A test module registers its runs at import (`register`); a test names the runs it reads
with `@pytest.mark.launches(NAME, …)` (a parametrized case: `marks=` on its `pytest.param`)
and gets each one's output directory and stderr lines from the session fixture `launched`
(conftest.py). The first request for a config launches, once, every run of that config that a
selected test names (`tests/scripts/several_runs.py`, in registration order, so a run that
resumes another's checkpoint comes after it). Each test asserts on its own run as it did on
its own launch; a run that fails fails the launch, and every test of it, with the output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from qwen35_accel.testing.launch import LAUNCH_TIMEOUT_S, REPO, accelerate_launch_command, describe, run_launch

DRIVER = REPO / "tests" / "scripts" / "several_runs.py"
MARK = "[several_runs]"
RUN_TIMEOUT_S = 240.0  # added to a launch's timeout per run it holds (a tiny run takes 5-60 s)


@dataclass(eq=False)
class Run:
    """One run of `script`: `python SCRIPT ARGV…`, or under `accelerate launch --config_file
    CONFIG` (a name in accelerate_configs/ or a path). In `argv`, `{out}` is this run's output
    directory, `{in}` a directory `setup(path)` fills in the test process before the launch
    (a checkpoint to load), `{out:NAME}` another run's output directory (`after` must name it).
    `env`: added to the environment for this run alone (read by the plugin and the FSDP plugin
    at `prepare`). `stdout`: rank 0's standard output of this run kept apart (`Launched.stdout`;
    what the launcher's process prints itself, not its ranks' processes). `batch`: runs of one config
    share a launch only if their `batch` names agree too (a group kept apart from the others: its
    failure, or what its scripts leave in the process, does not reach them)."""

    config: str | None
    script: Path
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    after: tuple[str, ...] = ()
    setup: Callable[[Path], None] | None = None
    stdout: bool = False
    batch: str = ""


RUNS: dict[str, Run] = {}


def register(**runs: Run) -> None:
    """Add runs by name (unique across the suite: prefix them with the module's subject)."""
    for name, run in runs.items():
        assert name not in RUNS, f"run {name!r} registered twice"
        assert all(dep in RUNS for dep in run.after), f"run {name!r}: register {run.after} before it"
        RUNS[name] = run


@dataclass
class Launched:
    """A finished run: its output directory, the directory its `setup` filled (`{in}`), the
    stderr lines rank 0 printed during it, and its standard output where its `Run.stdout` asked."""

    out: Path
    inputs: Path
    stderr: str
    launch: subprocess.CompletedProcess[str]
    stdout_file: Path | None = None

    @property
    def stdout(self) -> str:
        assert self.stdout_file is not None, "this run's stdout was not kept apart: register it with Run(..., stdout=True)"
        return self.stdout_file.read_text()


def _closure(names: set[str]) -> set[str]:
    todo, found = list(names), set()
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo.extend(RUNS[name].after)
    return found


def _segments(stderr: str) -> dict[str, tuple[str, bool]]:
    """{run name: (the launch's stderr from its begin mark to its end mark, or to the end of the
    output if it never ended; whether it ended)}, from the marks rank 0 writes on lines of their own."""
    found: dict[str, tuple[str, bool]] = {}
    marks = list(re.finditer(rf"^{re.escape(MARK)} (begin|end) (.+)$", stderr, re.M))
    for i, mark in enumerate(marks):
        if mark.group(1) != "begin":
            continue
        name = mark.group(2)
        end = next((m for m in marks[i + 1:] if m.group(1) == "end" and m.group(2) == name), None)
        found[name] = (stderr[mark.end() + 1:end.start() if end else len(stderr)], end is not None)
    return found


def _failure(name: str, batch: list[str], why: str, result: subprocess.CompletedProcess[str]) -> str:
    """What a test of a failed launch reports: its own run's state, and the stderr of the run that
    failed (its own if it is that run), then the launch's exit code and output tails."""
    segments = _segments(result.stderr)
    broken = [n for n in batch if n in segments and not segments[n][1]]
    state = ("failed" if name in broken else "finished" if name in segments
             else "did not start" if broken else "left no marks")
    text = f"the launch of runs {batch} {why}; this test's run {name!r} {state}"
    for n in broken:
        text += f"\n--- stderr of run {n!r} (every rank's lines after rank 0 began it; last 6000 chars) ---\n"
        text += segments[n][0][-6000:]
    return f"{text}\n--- the launch ---\n{describe(result)}"


class Launches:
    """The session's batched launches (the `launched` fixture)."""

    def __init__(self, items: list, base: Path) -> None:
        wanted = {name for item in items for marker in item.iter_markers("launches") for name in marker.args}
        unknown = wanted - set(RUNS)
        assert not unknown, f"@pytest.mark.launches names unregistered runs {sorted(unknown)}"
        self._wanted, self._base = _closure(wanted), base
        self._done: dict[str, Launched] = {}
        self._failed: dict[str, str] = {}

    def _dir(self, name: str) -> Path:
        return self._base / re.sub(r"[^\w.-]", "_", name)

    def _argv(self, name: str) -> list[str]:
        def fill(arg: str) -> str:
            arg = re.sub(r"\{out:([^}]+)\}", lambda m: str(self._dir(m.group(1)) / "out"), arg)
            return arg.replace("{out}", str(self._dir(name) / "out")).replace("{in}", str(self._dir(name) / "in"))

        return [fill(a) for a in RUNS[name].argv]

    def __call__(self, name: str) -> Launched:
        if name not in self._done and name not in self._failed:
            self._launch(name)
        if name in self._failed:
            raise AssertionError(self._failed[name])
        return self._done[name]

    def _launch(self, name: str) -> None:
        key = (RUNS[name].config, RUNS[name].batch)
        config = key[0]
        pending = self._wanted | _closure({name})
        batch = [n for n, run in RUNS.items() if n in pending and (run.config, run.batch) == key and n not in self._done]
        specs = []
        for n in batch:
            run = RUNS[n]
            self._dir(n).mkdir(parents=True, exist_ok=True)
            if run.setup is not None:
                (self._dir(n) / "in").mkdir(exist_ok=True)
                run.setup(self._dir(n) / "in")
            stdout = str(self._dir(n) / "stdout.txt") if run.stdout else None
            specs.append({"name": n, "script": str(run.script), "argv": self._argv(n), "env": dict(run.env), "stdout": stdout})
        spec = self._base / f"spec_{len(list(self._base.glob('spec_*')))}.json"
        spec.write_text(json.dumps(specs, indent=1))
        command = ([sys.executable, str(DRIVER), str(spec)] if config is None
                   else accelerate_launch_command(config, DRIVER, str(spec)))
        result = run_launch(command, timeout=LAUNCH_TIMEOUT_S + RUN_TIMEOUT_S * len(batch))
        if result.returncode != 0 or result.leftover_processes:
            why = "ranks outlived the launcher" if result.returncode == 0 else "failed"
            for n in batch:
                self._failed[n] = _failure(n, batch, why, result)
            return
        segments = _segments(result.stderr)
        for n in batch:
            if n in segments and segments[n][1]:
                kept = self._dir(n) / "stdout.txt" if RUNS[n].stdout else None
                self._done[n] = Launched(self._dir(n) / "out", self._dir(n) / "in", segments[n][0], result, kept)
            else:
                self._failed[n] = _failure(n, batch, "exited 0 without marking this run's end", result)
