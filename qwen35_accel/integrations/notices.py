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


def note_if_not_ours(error: BaseException, where: str) -> None:
    """Add a note to an error raised below a wrapper by the wrapped original alone (no frame of
    qwen35_accel between the wrapper and the raise), so a reader does not blame the plugin."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None  # below this wrapper
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package + os.sep):
            return  # a patch point of ours ran below: not only Accelerate's
        tb = tb.tb_next
    error.add_note(f"(raised by {where}; the qwen35_accel wrapper above it in the traceback only called it)")

