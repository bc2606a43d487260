"""Moved to `qwen35_accel.testing.local_world`; this alias goes once the benchmarks import from there."""

from .testing.local_world import *  # noqa: F401,F403
