"""Moved to `qwen35_accel.testing.tiny`; this alias goes once the benchmarks import from there."""

from .testing.tiny import *  # noqa: F401,F403
