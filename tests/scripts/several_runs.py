"""Several script runs one after the other in one interpreter: one launch (or one process) where
tests would otherwise start one per run (tests/_launched.py batches them).

    [accelerate launch --config_file …] tests/scripts/several_runs.py SPEC.json

SPEC.json: a list of {"name", "script", "argv", "env", "stdout"}. Each script runs as `python SCRIPT
ARGV…` runs it (`__name__ == "__main__"`, `sys.argv`), with `env` added to the environment and, where
"stdout" names a file, rank 0's standard output written there instead (other ranks': as usual); afterwards
this process is put back as a fresh one would be (environment, sys.path, warning filters, torch
defaults, Accelerate's singletons: `qwen35_accel.testing.process_state.reset_process_state`). The
Trainer builds its Accelerator anew for every run, so settings read at `prepare` (QWEN35_ACCEL_*,
the FSDP plugin's FSDP_* variables) are each run's own. Rank 0 marks each run on stderr
(`[several_runs] begin NAME` / `[several_runs] end NAME`), so a test reads its own run's lines.
An exception in any run ends the launch (the plugin's exit teardown ends the peers); a run's
`sys.exit(0)` ends that run alone, as a success.
"""

import contextlib
import json
import os
import runpy
import sys
import warnings

import torch

from qwen35_accel.testing.process_state import reset_process_state

MARK = "[several_runs]"


def _mark(what: str, name: str) -> None:
    """One line on a line of its own, whatever the ranks wrote before it: every rank writes to
    the launcher's one stderr pipe, and a line left open there (a progress bar's `\r…` on any
    rank, e.g. Transformers' weight loading on every rank) would otherwise run into the marker.
    One `os.write` of under PIPE_BUF bytes reaches the pipe whole."""
    if int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), f"\n{MARK} {what} {name}\n".encode())


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        runs = json.load(f)
    environ, path, filters = dict(os.environ), list(sys.path), list(warnings.filters)
    dtype, deterministic, threads = torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    argv = list(sys.argv)
    for run in runs:
        _mark("begin", run["name"])
        os.environ.update(run["env"])
        sys.argv = [run["script"], *run["argv"]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(run["script"])))  # as `python SCRIPT` puts it first
        kept = run.get("stdout") if int(os.environ.get("RANK", "0")) == 0 else None
        try:
            with contextlib.ExitStack() as stack:
                if kept:
                    stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(kept, "w"))))
                runpy.run_path(run["script"], run_name="__main__")
        except SystemExit as end:
            if end.code not in (0, None):  # sys.exit(0) ends `python SCRIPT` as a success: the next run goes on
                raise
        finally:
            sys.argv = argv
            reset_process_state(environ, path, filters, dtype, deterministic, threads)
        _mark("end", run["name"])


if __name__ == "__main__":
    main(sys.argv[1])
