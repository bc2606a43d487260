"""Run a command and everything it starts (a launcher and its ranks) with a hard timeout.

Launchers put their ranks in sessions of their own (torch elastic starts every worker
with a new session), and a rank whose launcher died is re-parented: neither the process
group nor the parent links find them all. Every process of a run carries a token in its
environment instead, inherited by everything it starts, and is found by it in `/proc`
(Linux; elsewhere only the command's own process group is killed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

_TOKEN_VARIABLE = "QWEN35_TESTING_PROCESS_TREE"


class ProcessTreeTimeout(TimeoutError):
    """The command outlived its timeout; it and its children were killed. Holds their output."""

    def __init__(self, cmd: Sequence[str], timeout: float, stdout: str, stderr: str) -> None:
        self.stdout, self.stderr = stdout, stderr
        super().__init__(
            f"killed after {timeout:.0f} s: {' '.join(cmd)}\n--- stdout tail ---\n{stdout[-3000:]}\n"
            f"--- stderr tail ---\n{stderr[-5000:]}"
        )


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, killed but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: alive as far as we can tell


def processes_with_token(token: str) -> list[int]:
    """Pids of the live processes whose environment holds this run's token (Linux /proc)."""
    needle = f"{_TOKEN_VARIABLE}={token}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and is_running(int(entry.name)):
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


def _kill_all(pgid: int, token: str) -> None:
    """SIGKILL every process of the run; return once none is left running (at most ~10 s)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10.0
    while (pids := processes_with_token(token)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def run_process_tree(
    cmd: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in a new session; return its result once it exits.

    On timeout every process of the session (the launcher's ranks too) is killed and
    `ProcessTreeTimeout` raised with the output so far. After a normal exit, processes
    the command left behind in its session are killed as well, and the result's
    `leftover_processes` is True (a launcher that exits must not leave ranks running).
    """
    token = uuid.uuid4().hex
    environment = dict(os.environ if env is None else env, **{_TOKEN_VARIABLE: token})
    process = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all(process.pid, token)
        stdout, stderr = process.communicate()
        raise ProcessTreeTimeout(cmd, timeout, stdout, stderr) from None
    leftover = False
    deadline = time.monotonic() + 5.0  # ranks get a moment to finish exiting after the launcher
    while processes_with_token(token):
        if time.monotonic() > deadline:
            leftover = True
            _kill_all(process.pid, token)
            break
        time.sleep(0.1)
    result = subprocess.CompletedProcess(list(cmd), process.returncode, stdout, stderr)
    result.leftover_processes = leftover  # type: ignore[attr-defined]
    return result
