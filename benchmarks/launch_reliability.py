"""Does a successful CPU launch exit 0 every time? Consecutive `accelerate launch` runs of the recipe.

    python benchmarks/launch_reliability.py [--runs 20] [--configs cpu_fsdp2.yaml cpu_fsdp2_cp2.yaml]
        [--max-steps 30] [--smoke] [--results-dir DIR]

Each run is `accelerate launch --config_file accelerate_configs/CONFIG recipes/sft.py`
(the recipe's defaults; `--max-steps` shortens it), with a hard timeout. Prints, per
config, how many runs exited 0, and for every other run its exit code and the end of
its stderr; writes the table to `benchmarks/results/launch_reliability.md` (a smoke run
writes nothing unless `--results-dir` is given).
Exit code: 0 when every run of every config exited 0, else 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import _report

from qwen35_accel.testing.launch import RECIPE, accelerate_launch_command, run_launch
from qwen35_accel.testing.processes import ProcessTreeTimeout

def one_run(config: str, max_steps: int, timeout: float) -> tuple[int | str, float, str]:
    """(exit code or 'timeout', seconds, stderr tail) of one launch."""
    with tempfile.TemporaryDirectory() as out:
        cmd = accelerate_launch_command(config, RECIPE, "--max_steps", str(max_steps), "--output_dir", out)
        started = time.perf_counter()
        try:
            result = run_launch(cmd, timeout=timeout)
        except ProcessTreeTimeout as error:
            return "timeout", time.perf_counter() - started, error.stderr[-1500:]
        code: int | str = result.returncode
        if result.returncode == 0 and getattr(result, "leftover_processes", False):
            code = "leftover processes"
        return code, time.perf_counter() - started, result.stderr[-1500:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--configs", nargs="+", default=["cpu_fsdp2.yaml", "cpu_fsdp2_cp2.yaml"])
    parser.add_argument("--max-steps", type=int, default=30, help="the recipe's default is 30")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a launch counts as hung")
    _report.add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:  # one run of two steps per config
        args.runs, args.max_steps = 1, 2

    run_record = _report.Run()
    rows, failures = [], []
    for config in args.configs:
        codes, seconds = [], []
        for run in range(args.runs):
            code, took, tail = one_run(config, args.max_steps, args.timeout)
            codes.append(code)
            seconds.append(took)
            print(f"{config} run {run + 1}/{args.runs}: exit {code} in {took:.1f} s", flush=True)
            if code != 0:
                failures.append((config, run + 1, code, tail))
        ok = sum(c == 0 for c in codes)
        rows.append((config, ok, len(codes), statistics.median(seconds)))

    lines = [
        "Consecutive `accelerate launch` runs of `recipes/sft.py`; a run counts when it exits 0 and leaves no "
        "process behind.",
        "",
        "| config | exited 0 | runs | median seconds per launch |",
        "|---|---|---|---|",
        *[f"| {c} | {ok} | {n} | {s:.1f} |" for c, ok, n, s in rows],
    ]
    for config, run, code, tail in failures:
        lines += ["", f"## {config} run {run}: exit {code}", "", "```", tail.strip(), "```"]
    report = "\n".join(lines)
    print(report)
    run_record.write(_report.results_dir(args), "launch_reliability.md", "Launch reliability", report)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
