"""Qwen3_5ForConditionalGeneration with a frozen vision tower, under each sharding policy."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from _dist import run_world
from _parity import assert_close, assert_grads_match

pytestmark = pytest.mark.multiprocess

ROWS = 2


def _frozen_vlm():
    from qwen35_accel.testing.tiny import build_tiny_vlm

    model = build_tiny_vlm(seed=0)
    model.model.visual.requires_grad_(False)
    return model


def _vlm_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import random_vlm_batch

    reference = _frozen_vlm()
    batch = random_vlm_batch(reference.config, ROWS * world, 24, seed=11)
    ref_loss = reference(**batch).loss
    ref_loss.backward()

    local = {k: v[rank * ROWS : (rank + 1) * ROWS] for k, v in batch.items() if k != "pixel_values"}
    local["pixel_values"] = batch["pixel_values"][rank * ROWS * 16 : (rank + 1) * ROWS * 16]

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    for policy in ("root", "replicate", "shard"):
        model = PARALLELIZER.apply(_frozen_vlm(), mesh, frozen_multimodal_sharding=policy)
        visual = model.model.visual
        block_is_unit = isinstance(visual.blocks[0], FSDPModule)
        vision_sharded = isinstance(visual.blocks[0].attn.qkv.weight, DTensor)
        assert (block_is_unit, vision_sharded) == {
            "root": (False, True),
            "replicate": (False, False),
            "shard": (True, True),
        }[policy], (policy, block_is_unit, vision_sharded)

        loss = model(**local).loss
        loss.backward()
        # Equal token counts per row: the global loss is the mean of the rank means.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        assert_close(global_loss, ref_loss.detach(), f"loss ({policy})")
        assert assert_grads_match(model, reference) > 0
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        opt.step()
        assert torch.isfinite(model(**local).loss), policy


def test_frozen_vision_tower_under_each_policy_trains_with_single_process_text_grads():
    run_world(_vlm_worker, 2)
