"""What every benchmark results file starts with, and where it goes.

`Run()` is created when a benchmark starts (it reads the load average then) and
`Run.header()` is called when the measurements are done: command, date, versions, machine
and the load average before / after, so a reader can tell an idle machine from a busy one.

Every benchmark takes `--smoke` (tiny shapes, one or two steps, for tests) and
`--results-dir`: a full run writes under `benchmarks/results` unless told otherwise; a smoke
run writes nothing unless `--results-dir` is given.

Scripts that draw write their results file first, then the picture: `pyplot()` is None
without matplotlib (the `benchmarks` extra), which costs the picture only.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, one or two steps (a test that the script runs); writes no results file unless --results-dir is given")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help=f"where the results file goes (default: {RESULTS.relative_to(RESULTS.parents[1])}; with --smoke: nowhere)")


def results_dir(args: argparse.Namespace) -> Path | None:
    """The folder to write results into (created), or None: a smoke run without --results-dir."""
    folder = args.results_dir if args.results_dir is not None else (None if args.smoke else RESULTS)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def pyplot() -> ModuleType | None:
    """`matplotlib.pyplot` on the Agg backend, or None (saying so in one line) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print('no picture: matplotlib is not installed (pip install -e ".[benchmarks]" installs it); the results stand without it')
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


def machine() -> str:
    import torch

    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f", {int(f.readline().split()[1]) / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    return f"{platform.machine()}, {os.cpu_count()} CPU cores{mem}{gpu}"


def versions() -> str:
    import accelerate
    import torch
    import transformers

    return (f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
            f"Python {platform.python_version()}")


def slowest_rank_steps(results: list[dict]) -> list[float]:
    """One world's step times, step by step, as its slowest rank took them (`results`: each rank's
    dict with its "times" list)."""
    return [max(ts) for ts in zip(*(res["times"] for res in results))]


def write_gathered(result: dict, world: int, rank: int, out_path: str) -> None:
    """All-gather every rank's `result` (a JSON-able dict) and have rank 0 write the list to `out_path`."""
    import json

    import torch.distributed as dist

    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))


class Run:
    """One benchmark run: the command line and the start (date, load) are taken now."""

    def __init__(self) -> None:
        script = Path(sys.argv[0])
        shown = f"benchmarks/{script.name}" if script.parent.name == "benchmarks" else str(script)
        self.command = " ".join(["python", shown, *sys.argv[1:]])
        self.started = datetime.now(timezone.utc)
        self.load_before = _load()

    def fields(self) -> dict[str, str]:
        """Command, date, duration, versions, machine, load average before / after (now)."""
        seconds = (datetime.now(timezone.utc) - self.started).total_seconds()
        return {
            "Command": self.command,
            "Date": f"{self.started:%Y-%m-%d %H:%M} UTC, {seconds:.0f} s",
            "Versions": versions(),
            "Machine": machine(),
            "Load average (1 / 5 / 15 min)": f"before: {self.load_before}; after: {_load()} (on {os.cpu_count()} cores)",
        }

    def header(self) -> str:
        """`fields()` as markdown list lines."""
        fields = self.fields()
        fields["Command"] = f"`{fields['Command']}`"
        return "\n".join(f"- {key}: {value}" for key, value in fields.items())

    def write(self, folder: Path | None, name: str, title: str, body: str, *, append: bool = False) -> Path | None:
        """Write `# title`, the header and `body` to folder/name (nothing when folder is None).

        append: keep the runs already in the file and add this one as a `## Run` section.
        """
        if folder is None:
            return None
        path = folder / name
        section = f"{self.header()}\n\n{body.strip()}\n"
        if append:
            previous = path.read_text() if path.exists() else f"# {title}\n"
            section = f"{previous.rstrip()}\n\n## Run {self.started:%Y-%m-%d %H:%M} UTC\n\n{section}"
        else:
            section = f"# {title}\n\n{section}"
        path.write_text(section)
        print(f"\nwrote {path}")
        return path


def world_json(worker: Callable[..., None], world: int, *args: Any, threads_per_rank: int = 1) -> Any:
    """Run `worker(rank, world, *args, path)` on a local gloo world (`HF_HUB_OFFLINE`, Transformers
    quiet) and return what rank 0 wrote to `path` as JSON."""
    import json
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from qwen35_accel.testing.local_world import run_local_world

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        run_local_world(worker, world, *args, path, threads_per_rank=threads_per_rank)
        with open(path) as f:
            return json.load(f)
