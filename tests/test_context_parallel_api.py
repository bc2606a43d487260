"""`shard_batch` / `gather_sequence`: the layout seen from a custom loop."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_world

pytestmark = pytest.mark.multiprocess


def _api_worker(rank: int, world: int) -> None:
    from qwen35_accel.context_parallel import gather_sequence, shard_batch
    from qwen35_accel.parallel.context_parallel.chunks import shard_sequence

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
    # Packed rows: cu_seq_lens only -> restarting position_ids, sharded; cu_seq_lens stay whole (padded).
    cu = torch.tensor([0, 4, 7, 10, 13, 20], dtype=torch.int32)  # 2 rows of 10: docs 4+3+3 and 3+7
    packed = shard_batch({"input_ids": ids, "cu_seq_lens_q": cu, "max_length_q": 7}, mesh)
    positions = gather_sequence(packed["position_ids"], mesh)
    assert positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]]
    assert packed["cu_seq_lens_q"].tolist() == [0, 4, 7, 12, 15, 24] and packed["max_length_q"] == 9
    with pytest.raises(ValueError, match="position_ids and cu_seq_lens_q describe different document boundaries"):
        shard_batch({"input_ids": ids, "position_ids": torch.arange(10).expand(2, 10), "cu_seq_lens_q": cu}, mesh)


def test_shard_batch_pads_shifts_and_shards_and_gather_inverts_it():
    run_world(_api_worker, 2)


def test_padding_for_context_parallel_keeps_every_packed_form_in_agreement():
    from qwen35_accel.context_parallel import pad_batch_for_context_parallel
    from qwen35_accel.model.packing import document_layout

    lengths = [[3, 2, 2], [1, 6]]  # two packed rows of 7 tokens; cp 2 pads them to 8
    positions = torch.tensor([sum((list(range(n)) for n in row), []) for row in lengths])
    seq_idx = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths])
    cu = torch.tensor([0, 3, 5, 7, 8, 14], dtype=torch.int32)
    batch = {"input_ids": torch.ones(2, 7, dtype=torch.long), "labels": torch.ones(2, 7, dtype=torch.long),
             "position_ids": positions, "seq_idx": seq_idx, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(),
             "max_length_q": 6, "max_length_k": 6}
    padded = pad_batch_for_context_parallel(batch, 2)
    assert padded["input_ids"].shape == (2, 8) and padded["labels"][:, 7].tolist() == [-100, -100]
    assert padded["position_ids"][:, 7].tolist() == [2, 6]  # the last document goes on
    # Mask-less rows get a mask marking the padding: counts of real tokens (TRL's) stay exact.
    assert padded["attention_mask"].tolist() == [[1] * 7 + [0]] * 2
    assert padded["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 9, 16] and padded["max_length_q"] == 7
    layout = document_layout(2, 8, position_ids=padded["position_ids"], seq_idx=padded["seq_idx"],
                             cu_seq_lens_q=padded["cu_seq_lens_q"], cu_seq_lens_k=padded["cu_seq_lens_k"])
    assert layout is not None and layout.cu_seq_lens.tolist() == [0, 3, 5, 8, 9, 16]
    assert pad_batch_for_context_parallel(padded, 2) is padded  # nothing missing: unchanged
