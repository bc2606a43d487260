"""TRL's `SFTTrainer`, unchanged (tests/scripts/trl_sft.py), through `accelerate launch` with
padding-free batches and with packing, against one process.

Padding-free rows hold the same examples as padded batches, so the oracle is the padded
single-process run of unmodified Transformers + TRL. Packed rows (TRL's BFD packing) have
no padded equivalent; their oracle is one process whose GatedDeltaNet layers compute
packed rows document by document (`install_fp32_gate`, checked against the unmodified
model document by document in tests/test_packing.py). TRL refuses packing under context
parallelism by its own check; padding-free batches it passes, and they run under cp 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from qwen35_accel.testing.launch import REPO, accelerate_launch_command, describe, run_launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch: each test launches worlds

SCRIPT = REPO / "tests" / "scripts" / "trl_sft.py"


def _run(command: list[str]) -> None:
    result = run_launch(command)
    assert result.returncode == 0, describe(result)
    assert not result.leftover_processes, f"ranks outlived the launcher\n{describe(result)}"


def _history(out: Path) -> tuple[torch.Tensor, torch.Tensor]:
    logged = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    assert len(logged) == 4
    return torch.tensor([e["loss"] for e in logged]), torch.tensor([e["grad_norm"] for e in logged])


def single(out: Path, mode: str, *flags: str) -> Path:
    _run([sys.executable, str(SCRIPT), str(out), mode, "4", *flags])  # per-device 4 = every launch's global batch
    return out


@pytest.fixture(scope="module")
def padded(tmp_path_factory) -> Path:
    return single(tmp_path_factory.mktemp("trl_padded"), "padded")


@pytest.mark.parametrize(
    "config,per_device,rtol",
    # fp32 rtol 1e-5: FSDP2's reduction order; rtol 1e-4 under CP: per-chunk partials
    # reduced over cp, carried through 4 SGD steps at lr 0.3 (as in test_trainer_launch).
    [("cpu_fsdp2.yaml", "2", 1e-5), ("cpu_fsdp2_cp2.yaml", "4", 1e-4)],
    ids=["fsdp2", "cp2"],
)
def test_sft_trainer_padding_free_trains_as_padded_batches_in_one_process(padded, tmp_path, config, per_device, rtol):
    out = tmp_path / "padding_free"
    _run(accelerate_launch_command(config, SCRIPT, str(out), "padding_free", per_device))
    (got_loss, got_norm), (want_loss, want_norm) = _history(out), _history(padded)
    assert got_loss[-1] < got_loss[0]
    torch.testing.assert_close(got_loss, want_loss, rtol=rtol, atol=0)
    torch.testing.assert_close(got_norm, want_norm, rtol=rtol, atol=0)


def test_sft_trainer_packing_trains_as_one_process_computing_each_document_alone(tmp_path):
    reference = single(tmp_path / "reference", "packing", "--packing_hook")
    out = tmp_path / "packing"
    _run(accelerate_launch_command("cpu_fsdp2.yaml", SCRIPT, str(out), "packing", "2"))
    (got_loss, got_norm), (want_loss, want_norm) = _history(out), _history(reference)
    # fp32 rtol 1e-5: FSDP2's reduction order.
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_norm, want_norm, rtol=1e-5, atol=0)
