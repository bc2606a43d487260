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


def _node_local_checkpoint_worker(rank: int, world: int, tmp: str) -> None:
    """Each rank a machine of its own: its checkpoint directory is `tmp/node{rank}`, nothing shared.

    A tp 2 model (PARALLELIZER.apply, as the plugin prepares it; Accelerate refuses FSDP with
    tp = world) and a real Accelerator's FSDP2 plugin; the FULL_STATE_DICT file is what
    Accelerate's `save_fsdp_model` writes (the gathered state dict, `torch.save` on rank 0).
    """
    import shutil
    import socket
    from pathlib import Path

    import accelerate.accelerator
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.integrations.transformers.trainer_checkpoints import check_same_checkpoint_on_every_rank
    from qwen35_accel.parallel.prepared import prepared_state
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="FULL_STATE_DICT"))
    mesh = init_device_mesh("cpu", (1, 1, 1, world), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")

    def prepared(seed: int) -> torch.nn.Module:
        model = PARALLELIZER.apply(build_tiny_causal_lm(seed=seed), mesh)
        prepared_state(model).source = "accelerate"  # what the plugin's preparation records
        return model

    def load(model: torch.nn.Module, directory: Path) -> None:  # what Accelerator.load_state calls for the model
        accelerate.accelerator.load_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, str(directory))

    nodes = [Path(tmp) / f"node{r}" for r in range(world)]
    nodes[rank].mkdir()
    saved = get_model_state_dict(prepared(seed=0), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(saved, nodes[0] / "pytorch_model_fsdp.bin")
    dist.barrier()

    # Rank 0 reads the file and broadcasts it; rank 1, whose node lacks it, needs none of it.
    model = prepared(seed=1)
    load(model, nodes[rank])
    loaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # where the full state dict is gathered
        assert set(loaded) == set(saved)
        for key, value in loaded.items():
            assert torch.equal(value, saved[key]), key

    # The file on rank 1's node only: every rank refuses, naming rank 0 and the ranks that have it.
    dist.barrier()
    if rank == 0:
        shutil.move(nodes[0] / "pytorch_model_fsdp.bin", nodes[1] / "pytorch_model_fsdp.bin")
    dist.barrier()
    host = socket.gethostname()
    with pytest.raises(ValueError, match=rf"rank 0 \(on {host}\) for every rank, and rank 0 does not have this file; ranks 1 \({host}\) do"):
        load(model, nodes[rank])
    # On no rank: FileNotFoundError on every rank (Accelerate's loading would fail on rank 0 alone).
    dist.barrier()
    if rank == 1:
        shutil.move(nodes[1] / "pytorch_model_fsdp.bin", Path(tmp) / "elsewhere.bin")
    dist.barrier()
    with pytest.raises(FileNotFoundError, match="no such file on any rank"):
        load(model, nodes[rank])

    # The Trainer's resume reads the checkpoint on every rank: directories whose files differ stop
    # it on every rank (per-rank RNG states aside); the same files pass.
    dist.barrier()
    if rank == 0:
        for r in range(world):
            torch.save({}, nodes[0] / f"rng_state_{r}.pth")
        torch.save({}, nodes[0] / "optimizer.bin")
    dist.barrier()
    with pytest.raises(ValueError, match=rf"ranks see different files \(rank 1 \({host}\) lacks \['optimizer.bin'\]"):
        check_same_checkpoint_on_every_rank(str(nodes[rank]))
    check_same_checkpoint_on_every_rank(str(nodes[0]))
    with pytest.raises(ValueError, match=rf"rank 1 \({host}\) has no such directory"):
        check_same_checkpoint_on_every_rank(str(nodes[0] if rank == 0 else Path(tmp) / "nowhere"))


def test_full_state_dict_checkpoints_on_one_node_only_load_or_fail_on_every_rank(tmp_path):
    from qwen35_accel.testing.local_world import run_local_world

    # Mismatched collectives hang rather than fail: a hard timeout well below the default.
    run_local_world(_node_local_checkpoint_worker, 2, str(tmp_path), timeout=180)
