"""Transformers' own sharding at load (`from_pretrained(..., distributed_config=DistributedConfig(...))`) under
torchrun, with an unchanged Trainer script (tests/scripts/distributed_config_trainer.py): data parallelism alone
(FSDP2, HSDP) is sharded by the plugin at load, so the gates sit in fp32 holders when the weights load: a
checkpoint saved as Qwen ships it (bf16 weights, fp32 gates, `dtype` "auto") trains them in fp32 from the
checkpoint's values, bitwise, and an fp32 load equals one process (before: a bf16 load trained them bf16-rounded,
silently). With tp (which Transformers shards), and under `QWEN35_ACCEL_DISTRIBUTED_CONFIG=check` for every
layout, the loads that would round them are refused on every rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _parity import assert_same_log_history
from test_bf16_load import _save_source, checkpoint_gate_values
from test_without_fsdp import assert_trained_in_fp32

from qwen35_accel.testing.launch import REPO, assert_refused_on_every_rank, describe, run_launch
from qwen35_accel.testing.local_world import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = REPO / "tests" / "scripts" / "distributed_config_trainer.py"
SHARDED = "Qwen3_5ForCausalLM sharded at load by qwen35_accel (distributed_config: "
REFUSED = "qwen35_accel: Qwen3_5ForCausalLM with Transformers' own sharding at load"


def _run(model: Path, dtype: str, out: Path, world: int = 2, *flags: str, env: dict[str, str] | None = None):
    launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(world),
                                      "--master_port", str(free_port())]
    result = run_launch([sys.executable, *launcher, str(SCRIPT), str(model), dtype, str(out), *flags], env=env)
    return result


def _trained(result, out: Path) -> list[dict]:
    assert result.returncode == 0 and not result.leftover_processes, describe(result)
    return [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("distributed_config") / "fp32"
    _save_source(path)  # the recipes' tiny model, saved in fp32
    return path


@pytest.fixture(scope="module")
def qwen_shaped(fp32_checkpoint, tmp_path_factory):
    """As Qwen ships its checkpoints: bf16 weights, fp32 A_log/dt_bias, config dtype bfloat16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fp32_checkpoint, dtype=torch.float32)
    for name, param in model.named_parameters():
        if not name.endswith((".A_log", ".dt_bias")):
            param.data = param.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    path = tmp_path_factory.mktemp("distributed_config") / "qwen_shaped"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_process(fp32_checkpoint, tmp_path_factory):
    """The reference run's output folder (fp32 load, no distributed_config)."""
    out = tmp_path_factory.mktemp("distributed_config") / "one_process"
    assert len(_trained(_run(fp32_checkpoint, "float32", out, 1), out)) == 4
    return out


@pytest.mark.parametrize("world,flags", [(2, ()), (4, ("--replicate", "2"))], ids=["fsdp2", "hsdp2x2"])
def test_an_fp32_load_sharded_at_load_equals_one_process(fp32_checkpoint, one_process, tmp_path, world, flags):
    result = _run(fp32_checkpoint, "float32", tmp_path, world, *flags)
    logged = _trained(result, tmp_path)
    replicate = dict(zip(flags[::2], flags[1::2])).get("--replicate", "1")
    assert result.stderr.count(f"{SHARDED}dp_replicate {replicate}, fsdp {world // int(replicate)})") == 1, describe(result)
    assert len(logged) == 4
    # Every value the Trainer logged, fp32 rtol 1e-5: the reduction order of the ranks' partial gradients.
    assert_same_log_history(tmp_path, one_process, rtol=1e-5)
    assert all(v.dtype == torch.float32 for v in checkpoint_gate_values(tmp_path).values())


def test_a_checkpoint_as_qwen_ships_it_trains_the_gates_in_fp32_from_its_values(qwen_shaped, tmp_path):
    """`dtype="auto"`: bf16 weights; the gates load into their fp32 holders bitwise and train in fp32 (the step-1
    loss equals the one-process Trainer's on the same load, which holds fp32 gates too: bf16 rounding apart)."""
    result = _run(qwen_shaped, "auto", tmp_path / "fsdp2")
    logged = _trained(result, tmp_path / "fsdp2")
    assert "fp32 gate holders (the checkpoint's values load into them in fp32, the rest in torch.bfloat16)" in result.stderr
    saved = checkpoint_gate_values(qwen_shaped)
    loaded = torch.load(tmp_path / "fsdp2" / "gates_at_load.pt")
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], v) and loaded[k].dtype == torch.float32 for k, v in saved.items())
    assert_trained_in_fp32(qwen_shaped, tmp_path / "fsdp2")
    reference = _trained(_run(qwen_shaped, "auto", tmp_path / "one", 1), tmp_path / "one")
    assert logged[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-2)


def test_fsdp_mixed_precision_keeps_the_gates_fp32(fp32_checkpoint, one_process, tmp_path):
    result = _run(fp32_checkpoint, "float32", tmp_path, 2, "--mixed_precision")
    logged = _trained(result, tmp_path)
    assert f"{SHARDED}dp_replicate 1, fsdp 2, fsdp_mixed_precision: bf16 compute)" in result.stderr, describe(result)
    reference = _trained(result, one_process)
    assert logged[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-2)  # bf16 compute
    assert_trained_in_fp32(fp32_checkpoint, tmp_path)


@pytest.mark.parametrize("flags,env,why", [
    ((), {"QWEN35_ACCEL_DISTRIBUTED_CONFIG": "check"}, ""),
    (("--tp", "2"), None, "qwen35_accel shards data parallelism alone at load, not tp 2."),
], ids=["check-fsdp2", "tp2"])
def test_a_bf16_load_left_to_transformers_sharding_is_refused_on_every_rank(qwen_shaped, tmp_path, flags, env, why):
    result = _run(qwen_shaped, "auto", tmp_path, 2, *flags, env=env)
    assert_refused_on_every_rank(result, "NotImplementedError", REFUSED)
    assert "the load dtype stores A_log/dt_bias as torch.bfloat16" in result.stderr, describe(result)
    assert why in result.stderr and "accelerate_configs/fsdp2.yaml" in result.stderr, describe(result)


@pytest.fixture(scope="module")
def moe_qwen_shaped(tmp_path_factory):
    """The tiny Qwen3.5-MoE as Qwen ships its checkpoints: bf16 weights, fp32 A_log/dt_bias."""
    from test_moe_launch import save_tiny_moe

    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

    path = tmp_path_factory.mktemp("distributed_config") / "moe_qwen_shaped"
    save_tiny_moe(path)
    model = build_tiny_moe_causal_lm(seed=0, vocab_size=264, eos_token_id=256, pad_token_id=256)
    for name, param in model.named_parameters():
        if not name.endswith((".A_log", ".dt_bias")):
            param.data = param.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(path)
    return path


def test_a_moe_checkpoint_as_qwen_ships_it_trains_the_gates_in_fp32_sharded_at_load(moe_qwen_shaped, tmp_path):
    """Qwen3.5-MoE with `distributed_config` (FSDP2 2, `dtype="auto"`): the plugin shards it at load as it
    does the dense family (before: Transformers' sharding, the gates trained bf16-rounded, silently);
    the gates load into their fp32 holders bitwise and train in fp32."""
    result = _run(moe_qwen_shaped, "auto", tmp_path)
    assert len(_trained(result, tmp_path)) == 4
    assert "Qwen3_5MoeForCausalLM sharded at load by qwen35_accel (distributed_config: dp_replicate 1, fsdp 2)" in result.stderr
    saved, loaded = checkpoint_gate_values(moe_qwen_shaped), torch.load(tmp_path / "gates_at_load.pt")
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], v) and loaded[k].dtype == torch.float32 for k, v in saved.items())
    assert_trained_in_fp32(moe_qwen_shaped, tmp_path)
