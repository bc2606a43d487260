"""Host syncs of a packed-row step (issue 47, item 2): the operations that make a CUDA host wait
(`.item()`, `nonzero`, boolean-mask indexes, ...), counted on CPU by a TorchDispatchMode
(`qwen35_accel.testing.host_syncs`). The documents' layout and groups are derived once per
forward, from one host copy, in the text model's pre-hook (the CP one under cp): a GatedDeltaNet
layer's forward makes none, so a model with more layers makes no more syncs. Before the groups
carried their scatter indices, each GatedDeltaNet layer made 4 boolean-mask indexes in one
process (2 in forward under cp 2): 8 with 3 layers, 16 with 6; before the hooks made the groups,
the first GatedDeltaNet layer of a forward made the groups' syncs (a unique, 2 nonzero per group)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from torch.distributed.device_mesh import init_device_mesh

from qwen35_accel.model.fp32_gate import install_fp32_gate
from qwen35_accel.testing.host_syncs import HostSyncCounter
from qwen35_accel.testing.tiny import build_tiny_causal_lm, packed_documents

LENGTHS = [5, 20, 7, 64]  # three padded lengths: three document groups


def _count_inside_gated_delta_nets(model: torch.nn.Module) -> HostSyncCounter:
    """A counter that counts inside every GatedDeltaNet layer's forward only."""
    syncs = HostSyncCounter()
    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            module.register_forward_pre_hook(lambda *_: (syncs.__enter__(), None)[1])
            module.register_forward_hook(lambda *_: (syncs.__exit__(None, None, None), None)[1])
    return syncs


def _one_process_step(layers: int) -> tuple[dict[str, int], dict[str, int]]:
    """(the whole step's syncs, those inside the GatedDeltaNet layers' forwards)."""
    model = build_tiny_causal_lm(num_hidden_layers=layers)
    install_fp32_gate(model)  # packed rows document by document (torch kernels on CPU)
    batch, _ = packed_documents(LENGTHS, model.config.vocab_size, seed=0)
    with HostSyncCounter() as syncs:
        model(**batch).loss.backward()
    inside = _count_inside_gated_delta_nets(model)
    model(**batch)
    return dict(syncs.counts), dict(inside.counts)


def test_counter_sees_the_ops_that_sync():
    x = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        x[x > 2].sum().item()
        torch.nonzero(x)
    assert syncs.counts == {"bool_index": 1, "item": 1, "nonzero": 1}


def test_a_packed_step_in_one_process_makes_no_more_host_syncs_with_more_layers():
    (three, _), (six, inside) = _one_process_step(3), _one_process_step(6)
    assert three == six, (three, six)
    assert "bool_index" not in six and six.get("nonzero", 0) <= 3, six  # the layout and groups, once per forward
    assert inside == {}, inside


def _cp_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch

    mesh = init_device_mesh("cpu", (1, 1, 2, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    counts = {}
    for layers in (3, 6):
        model = PARALLELIZER.apply(build_tiny_causal_lm(num_hidden_layers=layers), mesh)
        batch, _ = packed_documents(LENGTHS, model.config.vocab_size, seed=0)
        # SDPA's CausalBias (packed attention under CP) cannot run inside a dispatch mode: count
        # inside the GatedDeltaNet layers' forwards only.
        syncs = _count_inside_gated_delta_nets(model)
        model(**shard_batch(batch, mesh["cp"])).loss.backward()
        counts[layers] = dict(syncs.counts)
    assert counts[3] == counts[6] == {}, counts


@pytest.mark.multiprocess
def test_gated_delta_net_layers_under_cp2_make_no_more_host_syncs_with_more_layers():
    run_world(_cp_worker, 2)
