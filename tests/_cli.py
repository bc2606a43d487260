"""`qwen35-accel ARGS` in this process: the command's `main` with its stdout and stderr captured
and `env` added to the environment for the call. A fresh interpreter costs every call the
imports of torch and Transformers (5-10 s on a 2-core machine); tests/test_cli.py keeps a few
runs in a fresh process, as a user starts it."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from collections.abc import Mapping


def run_cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Exit code (`main`'s return, or argparse's SystemExit code), stdout and stderr of one call.
    The process is left as it was: the environment, and no process group (a call leaving one fails)."""
    import torch.distributed as dist

    from qwen35_accel.cli import main

    had_group, saved = dist.is_initialized(), dict(os.environ)
    os.environ.update(env or {})
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
        leaked = dist.is_initialized() and not had_group
        if leaked:  # a group must not reach later tests of this process (plan removes its own)
            dist.destroy_process_group()
    assert not leaked, f"qwen35-accel {' '.join(args)} left a process group behind"
    return subprocess.CompletedProcess(["qwen35-accel", *args], code or 0, out.getvalue(), err.getvalue())
