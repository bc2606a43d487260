"""Gathered full state dict of a sharded model -> save_pretrained -> from_pretrained."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from _dist import run_world
from _parity import assert_close

pytestmark = pytest.mark.multiprocess


def _train_one_step(model, rank: int) -> None:
    from qwen35_accel.testing.tiny import random_batch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**random_batch(2, 16, model.config.vocab_size, seed=rank)).loss.backward()
    opt.step()


def _roundtrip_worker(rank: int, world: int, out_dir: str) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    hf_keys = set(build_tiny_causal_lm(seed=0).state_dict())

    # fp32: the reloaded model computes the same logits as the sharded one.
    model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh)
    _train_one_step(model, rank)
    full_sd = get_model_state_dict(model, options=options)
    probe = random_batch(1, 24, model.config.vocab_size, seed=7)["input_ids"]
    with torch.no_grad():
        sharded_logits = model(input_ids=probe).logits
    if rank == 0:
        assert set(full_sd) == hf_keys, set(full_sd) ^ hf_keys
        build_tiny_causal_lm(seed=0).save_pretrained(f"{out_dir}/fp32", state_dict=dict(full_sd))
        loaded = AutoModelForCausalLM.from_pretrained(f"{out_dir}/fp32", dtype=torch.float32)
        with torch.no_grad():
            assert_close(loaded(input_ids=probe).logits, sharded_logits, "logits after reload")

    # bf16 storage: the gate parameters land in the file as F32, the rest as BF16.
    model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0, dtype=torch.bfloat16), mesh)
    _train_one_step(model, rank)
    full_sd = get_model_state_dict(model, options=options)
    if rank == 0:
        assert set(full_sd) == hf_keys
        build_tiny_causal_lm(seed=0, dtype=torch.bfloat16).save_pretrained(f"{out_dir}/bf16", state_dict=dict(full_sd))  # it pops keys
        with safe_open(f"{out_dir}/bf16/model.safetensors", "pt") as f:
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
            for key, dtype in dtypes.items():
                assert dtype == ("F32" if key.endswith(("A_log", "dt_bias")) else "BF16"), (key, dtype)
                assert torch.equal(f.get_tensor(key), full_sd[key]), key
    dist.barrier()


def test_gathered_state_dict_saves_and_reloads_as_transformers_checkpoint(tmp_path):
    run_world(_roundtrip_worker, 2, str(tmp_path))
