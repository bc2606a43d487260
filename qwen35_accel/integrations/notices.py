"""What the plugin tells the user: a line on the main process, a warning once per process."""

from __future__ import annotations

import os
import sys
import warnings

_warned: set[str] = set()


def main_process_note(message: str) -> None:
    """One line on the main process: what the plugin did (visible in launcher logs)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[qwen35_accel] {message}", file=sys.stderr, flush=True)


def warn_once(message: str) -> None:
    """`message` as a warning, the first time only; attributed to the caller of the caller."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
