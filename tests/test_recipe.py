"""recipes/sft.py after a plain `pip install .` (no `datasets`): the README demo's bundled data set
loads as a list of the same tokenized examples the `datasets` path makes; a Hub data set asks for
the package by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build(tmp_path: Path, without_datasets: bool, *argv: str) -> subprocess.CompletedProcess:
    script = (
        "import json, sys\n"
        + ("sys.modules['datasets'] = None  # what a plain install lacks: `import datasets` raises\n" if without_datasets else "")
        + "sys.path.insert(0, 'recipes')\n"
        "import sft\n"
        f"args, training = sft.parse_args(['--output_dir', {str(tmp_path)!r}, *{list(argv)!r}])\n"
        "rows = sft.build_dataset(args, training, sft.load_tokenizer(args))\n"
        "print(json.dumps([{k: list(v) for k, v in dict(row).items()} for row in rows]))\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(ROOT), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})


def test_the_bundled_data_set_loads_without_datasets_as_with_it(tmp_path):
    with_datasets, without = _build(tmp_path, False), _build(tmp_path, True)
    assert with_datasets.returncode == 0 and without.returncode == 0, (with_datasets.stderr[-2000:], without.stderr[-2000:])
    rows = json.loads(without.stdout.strip().splitlines()[-1])
    assert rows == json.loads(with_datasets.stdout.strip().splitlines()[-1]) and len(rows) > 10
    hub = _build(tmp_path, True, "--dataset_name", "trl-lib/Capybara")
    assert hub.returncode != 0 and "--dataset_name trl-lib/Capybara needs the datasets package: pip install datasets" in hub.stderr
