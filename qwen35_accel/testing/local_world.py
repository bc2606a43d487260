"""The local gloo world runner, re-exported for tests and benchmarks: it lives in the product
(`qwen35_accel.local_world`, the demo runs on it)."""

from ..local_world import DEFAULT_TIMEOUT_S, free_port, run_local_world

__all__ = ["DEFAULT_TIMEOUT_S", "free_port", "run_local_world"]
