"""`shard_batch` / `gather_sequence`: the layout seen from a custom loop."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_world

pytestmark = pytest.mark.multiprocess


def _api_worker(rank: int, world: int) -> None:
    from qwen35_accel.context_parallel import gather_sequence, shard_batch
    from qwen35_accel.parallel.context_parallel.layout import shard_sequence

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cp = world
    ids = torch.arange(1, 2 * 10 + 1).reshape(2, 10)  # 10 is not divisible by 2*cp = 4: padded to 12
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 8:] = 0  # right padding in the batch itself
    local = shard_batch({"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}, mesh)
    assert local["input_ids"].shape == (2, 12 // cp)

    whole = {k: gather_sequence(local[k], mesh) for k in ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask")}
    assert torch.equal(whole["input_ids"][:, :10], ids) and (whole["input_ids"][:, 10:] == 0).all()
    assert torch.equal(whole["labels"][:, :10], ids) and (whole["labels"][:, 10:] == -100).all()
    assert torch.equal(whole["shift_labels"][:, :9], ids[:, 1:]) and (whole["shift_labels"][:, 9:] == -100).all()
    assert torch.equal(whole["position_ids"], torch.arange(12).expand(2, 12))
    assert torch.equal(whole["attention_mask"][:, :10], mask) and (whole["attention_mask"][:, 10:] == 0).all()

    # gather_sequence is autograd-aware: each rank's part receives its slice's gradient.
    x = local["position_ids"].float().requires_grad_()
    weights = torch.arange(24.0).reshape(2, 12)
    (gather_sequence(x, mesh) * weights).sum().backward()  # every rank: same loss
    assert torch.equal(x.grad, cp * shard_sequence(weights, cp, rank))

    with pytest.raises(ValueError, match="right padding only"):
        shard_batch({"input_ids": ids, "attention_mask": torch.tensor([[0] * 2 + [1] * 8] * 2)}, mesh)
    with pytest.raises(ValueError, match="packed sequences"):
        shard_batch({"input_ids": ids, "position_ids": torch.tensor([list(range(5)) * 2] * 2)}, mesh)


def test_shard_batch_pads_shifts_and_shards_and_gather_inverts_it():
    run_world(_api_worker, 2)
