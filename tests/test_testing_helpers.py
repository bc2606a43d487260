"""The test scaffolding's hard timeouts: a deadlock fails, never hangs, and leaves nothing running."""

from __future__ import annotations

import sys
import time

import pytest
import torch.distributed as dist

from qwen35_accel.testing.local_world import run_local_world
from qwen35_accel.testing.processes import ProcessTreeTimeout, is_running, run_process_tree


def _deadlocked_worker(rank: int, world: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(3600)


@pytest.mark.multiprocess
def test_a_deadlocked_local_world_raises_timeout_error_naming_the_ranks(capfd):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] were still running"):
        run_local_world(_deadlocked_worker, 2, timeout=20)
    assert time.monotonic() - started < 60
    assert "_deadlocked_worker" in capfd.readouterr().err  # each rank's Python stack was dumped


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
