"""torchrun with FSDP2 and context parallelism configured in `TrainingArguments` (no Accelerate
config file): `fsdp="full_shard auto_wrap"` / `fsdp=True` with `fsdp_config={"version": 2, ...}`,
and `parallelism_config=ParallelismConfig(cp_size=2)`, against one process on the same global
batch (docs/torchrun.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _launched import Run, register
from test_trainer_launch import assert_same_training

from qwen35_accel.testing.launch import describe, run_launch
from qwen35_accel.testing.local_world import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_trainer.py"
PREPARED = "prepared by qwen35_accel"


register(**{"torchrun/single": Run(None, SCRIPT, ("{out}",))})  # one process: the reference, in {out}/single


@pytest.mark.launches("torchrun/single")
def test_torchrun_with_fsdp2_and_cp_in_training_arguments_trains_as_one_process(launched, tmp_path):
    single = launched("torchrun/single").out / "single"
    # One torchrun, two Trainers one after the other: fsdp2 (dp 2), then cp 2.
    result = run_launch(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(SCRIPT), str(tmp_path)]
    )
    assert result.returncode == 0 and not result.leftover_processes, describe(result)
    prepared = [line for line in result.stderr.splitlines() if PREPARED in line]
    assert len(prepared) == 2, describe(result)  # the plugin took over both, each noted once (rank 0)
    assert "mesh {'dp_shard_cp': 2}, cp=1" in prepared[0] and "mesh {'cp': 2}, cp=2" in prepared[1], prepared
    # Every logged value per step (loss, grad_norm, learning_rate, epoch, train_loss), total_flos and
    # the saved weights: fp32 rtol 1e-5 for FSDP2 (the two ranks' gradients summed in another
    # order); 1e-4 under cp, as in test_trainer_launch.py (per-chunk partial gradients reduced over
    # cp, carried through 4 SGD steps at lr 0.3).
    assert_same_training(tmp_path / "fsdp2", single, rtol=1e-5, flos=True)
    assert_same_training(tmp_path / "cp2", single, rtol=1e-4, flos=True)
