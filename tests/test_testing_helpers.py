"""The test scaffolding's hard timeouts: a deadlock fails, never hangs, and leaves nothing running."""

from __future__ import annotations

import sys
import time

import pytest
import torch.distributed as dist

from qwen35_accel.local_world import START_METHOD_VAR
from qwen35_accel.testing.local_world import run_local_world
from qwen35_accel.testing.processes import ProcessTreeTimeout, is_running, run_process_tree


def _deadlocked_worker(rank: int, world: int, reached: str | None = None) -> None:
    if reached is not None:
        open(f"{reached}.{rank}", "w").close()  # this rank runs the worker (its dump handler is registered)
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(3600)


@pytest.mark.multiprocess
def test_a_deadlocked_local_world_raises_timeout_error_naming_the_ranks(capfd, tmp_path):
    # A rank still starting at the deadline (imports under a load average of 100+ took over 20 s once) is
    # killed before it can print a stack: then the world runs once more with a longer bound.
    for timeout in (20, 90):
        reached = tmp_path / f"reached_{timeout}"
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] were still running"):
            run_local_world(_deadlocked_worker, 2, str(reached), timeout=timeout)
        assert time.monotonic() - started < timeout + 40
        if all(reached.with_suffix(f".{rank}").exists() for rank in (0, 1)):
            break
    assert "_deadlocked_worker" in capfd.readouterr().err  # each rank's Python stack was dumped


def _environment_worker(rank: int, world: int, path: str) -> None:
    import os

    import torch

    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    with open(f"{path}.{rank}", "w") as f:
        f.write(f"{os.environ.get('QWEN35_PROBE')} {'transformers' in sys.modules} {total.item()}")


@pytest.mark.multiprocess
def test_forkserver_worlds_start_with_the_callers_current_environment_and_the_preloaded_modules(tmp_path, monkeypatch):
    # The tests (tests/_dist.py) and the benchmark smokes start their worlds this way: forked from one server
    # that imported torch and Transformers once, each rank must still see the environment as the caller
    # set it for that world (the server keeps the one it started with), and a failing rank still fails the call.
    monkeypatch.setenv(START_METHOD_VAR, "forkserver")
    for value in ("first", "second"):
        monkeypatch.setenv("QWEN35_PROBE", value)
        run_local_world(_environment_worker, 2, str(tmp_path / value))
        assert [(tmp_path / f"{value}.{rank}").read_text() for rank in (0, 1)] == [f"{value} True 1.0"] * 2
    with pytest.raises(Exception, match="rank 1 stops here"):
        run_local_world(_failing_worker, 2, timeout=60)
    with pytest.raises(ValueError, match=r"start='fork': expected one of"):
        run_local_world(_environment_worker, 2, str(tmp_path / "never"), start="fork")


def _failing_worker(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 stops here")
    dist.barrier()  # rank 0 waits in a collective its peer never joins


def test_resetting_a_process_after_a_script_run_puts_back_what_the_run_changed(monkeypatch):
    # tests/scripts/several_runs.py calls it between the runs of one launch: the next run must not see the
    # previous run's environment, sys.path entry, warning filter, default dtype, grad mode or thread count.
    import os
    import warnings

    import torch

    from qwen35_accel.testing.process_state import reset_process_state

    monkeypatch.delenv("QWEN35_RUN_LEFTOVER", raising=False)

    def state() -> tuple:
        return (dict(os.environ), list(sys.path), list(warnings.filters), torch.get_default_dtype(),
                torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())

    reset_process_state(*state())  # once first: torch's calls in it import modules that add warning filters
    before = state()
    try:
        os.environ["QWEN35_RUN_LEFTOVER"] = "1"
        sys.path.insert(0, "/a/run's/script/folder")
        warnings.simplefilter("error", FutureWarning)
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.set_num_threads(max(1, before[5] + 1))
    finally:
        reset_process_state(*before)
    assert "QWEN35_RUN_LEFTOVER" not in os.environ and sys.path == before[1] and warnings.filters == before[2]
    assert torch.get_default_dtype() == before[3] and torch.is_grad_enabled() and torch.get_num_threads() == before[5]


# A "launcher" that starts a worker in a session of its own (as torch elastic does) and hangs.
_LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
open(sys.argv[1], "w").write(str(worker.pid))
time.sleep(3600)
"""


def test_a_hung_command_is_killed_with_the_workers_it_started_in_other_sessions(tmp_path):
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(ProcessTreeTimeout, match="killed after 10 s"):
        run_process_tree([sys.executable, "-c", _LAUNCHER, str(pid_file)], timeout=10)
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while is_running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_running(worker)


_LAUNCHER_THAT_RETURNS = """
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
open(sys.argv[1], "w").write(str(worker.pid))
"""


def test_workers_left_behind_by_a_finished_command_are_reported_and_killed(tmp_path):
    pid_file = tmp_path / "worker.pid"
    result = run_process_tree([sys.executable, "-c", _LAUNCHER_THAT_RETURNS, str(pid_file)], timeout=60)
    assert result.returncode == 0 and result.leftover_processes
    assert not is_running(int(pid_file.read_text()))


class _Item:
    """What `Launches` reads of a selected test: its `launches` markers."""

    def __init__(self, *names: str) -> None:
        self._mark = pytest.mark.launches(*names).mark

    def iter_markers(self, name: str):
        return iter([self._mark] if name == "launches" else [])


_SHOW = """import json, os, sys
print("stderr of", sys.argv[1], file=sys.stderr)
os.makedirs(sys.argv[2], exist_ok=True)
with open(os.path.join(sys.argv[2], "seen.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "x": os.environ.get("SHOW_X"), "leaked": os.environ.get("SHOW_LEAK"),
               "pid": os.getpid(), "main": __name__}, f)
os.environ["SHOW_LEAK"] = "1"  # must not reach the next run
print("stdout of", sys.argv[1])
sys.exit(0)  # as `python SCRIPT` may end: a success, and the next run goes on
"""


def test_batched_runs_share_one_process_each_with_its_own_arguments_environment_and_stderr(tmp_path, monkeypatch):
    import json

    from _launched import RUNS, Launches, Run

    script = tmp_path / "show.py"
    script.write_text(_SHOW)
    runs = {"helpers/a": Run(None, script, ("a", "{out}"), env={"SHOW_X": "1"}, stdout=True),
            "helpers/b": Run(None, script, ("b", "{out}", "{out:helpers/a}"), after=("helpers/a",)),
            "helpers/unselected": Run(None, script, ("u", "{out}")),
            "helpers/apart": Run(None, script, ("c", "{out}"), batch="apart")}
    for name, run in runs.items():
        monkeypatch.setitem(RUNS, name, run)
    launched = Launches([_Item("helpers/b"), _Item("helpers/apart")], tmp_path / "base")  # b reads a's output: a runs too
    b, a = launched("helpers/b"), launched("helpers/a")
    seen_a, seen_b = (json.loads((r.out / "seen.json").read_text()) for r in (a, b))
    assert seen_a["pid"] == seen_b["pid"] and seen_a["main"] == seen_b["main"] == "__main__"  # one process
    assert seen_a["argv"] == ["a", str(a.out)] and seen_b["argv"] == ["b", str(b.out), str(a.out)]
    assert (seen_a["x"], seen_b["x"], seen_b["leaked"]) == ("1", None, None)  # each run's own environment
    assert a.stderr.strip() == "stderr of a" and b.stderr.strip() == "stderr of b"
    assert a.stdout == "stdout of a\n"  # kept apart where asked (b's went to the launch's own stdout)
    with pytest.raises(AssertionError, match="stdout=True"):
        b.stdout
    assert not (tmp_path / "base" / "helpers_unselected").exists()
    apart = json.loads((launched("helpers/apart").out / "seen.json").read_text())
    assert apart["pid"] != seen_a["pid"] and apart["argv"] == ["c", str(launched("helpers/apart").out)]  # a batch of its own


def test_a_failed_run_fails_every_test_of_its_launch_naming_the_run_with_its_own_stderr(tmp_path, monkeypatch):
    from _launched import RUNS, Launches, Run

    (tmp_path / "fail.py").write_text("import sys\nprint('fail.py says', file=sys.stderr)\nraise RuntimeError('run a failed')\n")
    (tmp_path / "ok.py").write_text("import sys\nprint('ok.py says', file=sys.stderr)\n")
    monkeypatch.setitem(RUNS, "helpers/ok", Run(None, tmp_path / "ok.py"))
    monkeypatch.setitem(RUNS, "helpers/fail", Run(None, tmp_path / "fail.py"))
    monkeypatch.setitem(RUNS, "helpers/after", Run(None, tmp_path / "ok.py"))
    launched = Launches([_Item("helpers/ok"), _Item("helpers/fail"), _Item("helpers/after")], tmp_path / "base")
    batch = r"the launch of runs \['helpers/ok', 'helpers/fail', 'helpers/after'\] failed"
    own = r"--- stderr of run 'helpers/fail' [^\n]*\nfail.py says\n(?:(?!ok.py says).)*run a failed"
    for name, state in (("helpers/after", "did not start"), ("helpers/fail", "failed"), ("helpers/ok", "finished")):
        with pytest.raises(AssertionError, match=rf"(?s){batch}; this test's run '{name}' {state}\n{own}"):
            launched(name)  # one launch; later requests do not relaunch
    assert len(list((tmp_path / "base").glob("spec_*.json"))) == 1


def test_a_run_after_a_line_left_open_keeps_its_own_output(tmp_path, monkeypatch):
    """A progress bar (`\r` updates, no newline) on any rank leaves the launch's stderr mid-line when
    rank 0 marks the next run: the marks must still start lines of their own (under load a rank's
    weight-loading bar met rank 0's mark, and the test found no output of its run)."""
    from _launched import RUNS, Launches, Run

    (tmp_path / "bar.py").write_text("import sys\nsys.stderr.write('loading 1/2\\rloading 2/2'); sys.stderr.flush()\n")
    (tmp_path / "note.py").write_text("import sys\nprint('note of', sys.argv[1], file=sys.stderr)\n")
    monkeypatch.setitem(RUNS, "helpers/bar", Run(None, tmp_path / "bar.py"))
    monkeypatch.setitem(RUNS, "helpers/note", Run(None, tmp_path / "note.py", ("n",)))
    launched = Launches([_Item("helpers/bar", "helpers/note")], tmp_path / "base")
    assert launched("helpers/bar").stderr.strip().splitlines() == ["loading 1/2", "loading 2/2"]  # text mode: \r read as \n
    assert launched("helpers/note").stderr.strip() == "note of n"
