"""Activation checkpointing per decoder layer composes with FSDP2 and changes nothing."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_world
from _parity import assert_close, full

pytestmark = pytest.mark.multiprocess


def _ac_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    results = {}
    for ac in (False, True):
        model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh, activation_checkpointing=ac)
        saved = []  # tensors the forward keeps for backward
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
            loss = model(**random_batch(2, 32, model.config.vocab_size, seed=rank)).loss
        loss.backward()
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        results[ac] = (loss.detach(), grads, len(saved))
    (loss_off, grads_off, saved_off), (loss_on, grads_on, saved_on) = results[False], results[True]
    # Checkpointed layers keep only their inputs; everything else is recomputed.
    assert saved_on < saved_off / 4, (saved_on, saved_off)
    # Recomputation runs the same kernels in the same order: agreement to the last bits.
    assert_close(loss_on, loss_off, "loss", rtol=1e-6, atol=0)
    for name in grads_off:
        assert_close(grads_on[name], grads_off[name], f"grad of {name}", rtol=1e-6, atol=1e-9)
    # Names stay the Transformers ones (no wrapper module in the path).
    assert not any("checkpoint" in n for n in grads_on)


def test_activation_checkpointing_on_and_off_give_same_loss_and_grads():
    run_world(_ac_worker, 2)
