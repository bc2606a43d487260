"""Multi-node: two `accelerate launch` processes acting as two machines on this one.

Each launcher is what a user runs on one node (`--num_machines 2 --machine_rank 0|1
--main_process_ip 127.0.0.1`, the same port), 2 CPU processes each, HSDP dp_replicate 2
(one replica per "machine") x dp_shard 2 (inside one), against one process without a
launcher on the same global batch. Each "machine" writes to a directory of its own, as
nodes without a shared filesystem do.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _launched import Run, register

from qwen35_accel.testing.launch import CONFIGS, RECIPE, describe, run_launch
from qwen35_accel.testing.local_world import free_port
from test_trainer_launch import COMMON, PREPARED, SGD, assert_same_training

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TWO_MACHINES = Path(__file__).parent / "scripts" / "two_machines.py"


def machine_command(config: Path, machine_rank: int, port: int, *args: str) -> list[str]:
    """What a user runs on node `machine_rank` (the config's main_process_ip and port given explicitly)."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_machines", "2",
        "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
        str(RECIPE), *args,
    ]


register(**{"multi_node/reference": Run(None, RECIPE, (*COMMON, "--output_dir", "{out}", "--per_device_train_batch_size", "4", *SGD))})


@pytest.mark.launches("multi_node/reference")
def test_two_machines_hsdp_trains_exactly_as_one_process(launched, tmp_path):
    reference = launched("multi_node/reference").out

    # No shared filesystem: each machine its own output directory (and periodic checkpoint).
    outs = [tmp_path / "hsdp", tmp_path / "machine1"]
    port = free_port()
    args = (*COMMON, "--per_device_train_batch_size", "1", "--save_strategy", "steps", "--save_steps", "2", *SGD)
    config = CONFIGS / "cpu_fsdp2_2nodes_hsdp.yaml"
    commands = [machine_command(config, r, port, *args, "--output_dir", str(outs[r])) for r in (0, 1)]
    # One process tree: on timeout both launchers and their ranks are killed; if one launcher
    # fails, the driver ends the other at once (it would wait for its peer machine).
    result = run_launch([sys.executable, str(TWO_MACHINES), json.dumps(commands)])
    assert result.returncode == 0, describe(result)
    assert not result.leftover_processes, f"ranks outlived the launchers\n{describe(result)}"
    # Global rank 0 alone prints the plugin's notes: one line for the whole launch, from machine 0
    # (a note keyed on LOCAL_RANK would print once per machine).
    prepared = [line for line in result.stderr.splitlines() if PREPARED in line]
    assert len(prepared) == 1 and prepared[0].startswith("[machine 0]"), prepared
    assert "'dp_replicate': 2" in prepared[0], prepared[0]
    # fp32 rtol 1e-5: HSDP sums the 4 data-parallel ranks' gradients (reduce-scatter inside a
    # machine, all-reduce across) in another order than one process; nothing else differs.
    assert_same_training(outs[0], reference, rtol=1e-5)
    # Global rank 0 writes the model, the optimizer and the Trainer's state, on machine 0; every
    # rank writes its RNG state into its own machine's checkpoint.
    node0, node1 = (sorted(p.name for p in (out / "checkpoint-2").iterdir()) for out in outs)
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(node0)
    assert node1 == ["rng_state_2.pth", "rng_state_3.pth"], node1
    assert not (outs[1] / "model.safetensors").exists()
