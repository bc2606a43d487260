"""`qwen35-accel` command line (placeholder until the plan/env commands land)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    raise SystemExit("qwen35-accel: commands not implemented yet")
