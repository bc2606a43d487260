"""Transformers' own sharding at load (`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`
under torchrun, tests/scripts/distributed_config_load.py) on a checkpoint saved as Qwen ships it (fp32 gates):
where its FSDP2 would train the gates bf16-rounded (a bf16 load; `fsdp_mixed_precision`) the load is refused on
every rank, naming the ways that keep them fp32; an fp32 load trains as Transformers has it, gates fp32
(before the patch point, the bf16 load trained with bf16 gates, silently)."""

from __future__ import annotations

import sys

import pytest
from test_bf16_load import _save_source

from qwen35_accel.testing.launch import REPO, assert_refused_on_every_rank, describe, run_launch
from qwen35_accel.testing.local_world import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = REPO / "tests" / "scripts" / "distributed_config_load.py"
REFUSED = "qwen35_accel: Qwen3_5ForCausalLM with Transformers' own sharding at load"


def _torchrun(model, dtype: str, *flags: str):
    return run_launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                       str(free_port()), str(SCRIPT), str(model), dtype, *flags])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("distributed_config") / "model"
    _save_source(path)  # the recipes' tiny model, saved in fp32
    return path


@pytest.mark.parametrize("dtype,flags,why", [
    ("bfloat16", (), "the load dtype stores A_log/dt_bias as torch.bfloat16"),
    ("float32", ("--mixed_precision",), "fsdp_mixed_precision computes each decoder layer's unit"),
], ids=["bf16-load", "fsdp-mixed-precision"])
def test_loads_that_would_round_the_gates_are_refused_on_every_rank(checkpoint, dtype, flags, why):
    result = _torchrun(checkpoint, dtype, *flags)
    assert_refused_on_every_rank(result, "NotImplementedError", REFUSED)
    assert why in result.stderr and "accelerate_configs/fsdp2.yaml" in result.stderr, describe(result)


def test_an_fp32_load_is_left_to_transformers_with_fp32_gates(checkpoint):
    result = _torchrun(checkpoint, "float32")
    assert result.returncode == 0 and not result.leftover_processes, describe(result)
    assert "gates ['torch.float32']" in result.stdout, describe(result)
