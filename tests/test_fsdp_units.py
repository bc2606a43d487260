"""The FSDP2 units PARALLELIZER.apply makes: dtype-uniform per layer, tail, prefetch order."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from _dist import run_world

pytestmark = pytest.mark.multiprocess


def prefetch_of(model, unit, kind: str) -> list[str]:
    """Names (first module) of the units that `unit` (layer index, or a module of a unit)
    gathers ahead in `kind` ("forward"/"backward"), read from FSDP2's own state: what the
    package records must be what FSDP2 does (checked against describe_prefetch below)."""
    name_of = {m: n for n, m in model.named_modules()}
    state = (model.model.layers[unit] if isinstance(unit, int) else unit)._get_fsdp_state()
    states = state._states_to_forward_prefetch if kind == "forward" else state._states_to_backward_prefetch
    return [name_of[s._modules[0]] for s in states]


def assert_records_are_fsdps_own(model) -> None:
    """The units and prefetch lists qwen35_accel records equal FSDP2's private state."""
    from qwen35_accel.parallel.fsdp import describe_prefetch, fsdp_units

    label_of_group = {}
    for names, record in fsdp_units(model):
        group = record.modules[0]._get_fsdp_state()._fsdp_param_group
        assert {id(fp.sharded_param) for fp in group.fsdp_params} == {id(p) for p in record.parameters()}, names
        assert len(group.fsdp_params) == len(record.parameters()), names
        # torch <= 2.14 keeps one policy per group; torch 2.15 resolves it per parameter (FSDPParam.mp_policy)
        policies = [group.mp_policy] if hasattr(group, "mp_policy") else [fp.mp_policy for fp in group.fsdp_params]
        assert all(policy == record.mp_policy for policy in policies), (names, policies, record.mp_policy)
        label_of_group[id(group)] = "+".join(names)
    fsdp_view = {"forward": {}, "backward": {}}
    for names, record in fsdp_units(model):
        state = record.modules[0]._get_fsdp_state()
        for kind, states in (("forward", state._states_to_forward_prefetch), ("backward", state._states_to_backward_prefetch)):
            targets = [label_of_group[id(s._fsdp_param_group)] for s in states if id(s._fsdp_param_group) in label_of_group]
            if targets:
                fsdp_view[kind]["+".join(names)] = targets
    assert describe_prefetch(model) == fsdp_view


def _units_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.fsdp import describe_units, fsdp_units
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    model = PARALLELIZER.apply(build_tiny_causal_lm(num_hidden_layers=6), mesh, mp_policy=policy)
    units = {row["unit"]: row for row in describe_units(model)}
    gdn_layers = [i for i, l in enumerate(model.model.layers) if l.block_type == "linear_attention"]
    expected = {"model.embed_tokens", "model.norm+lm_head"}  # the root unit is left with no parameters
    expected |= {f"model.layers.{i}" for i in range(6)}
    expected |= {f"model.layers.{i}.linear_attn._fp32_params" for i in gdn_layers}
    assert set(units) == expected, sorted(units)
    for i in gdn_layers:
        holder = units[f"model.layers.{i}.linear_attn._fp32_params"]
        assert (holder["storage"], holder["compute"], holder["params"]) == ("float32", "float32", 2 * 4)
    assert {units[f"model.layers.{i}"]["compute"] for i in range(6)} == {"bfloat16"}
    # Sizes add up: every parameter is in exactly one unit.
    assert sum(r["params"] for r in units.values()) == sum(p.numel() for p in model.parameters())
    assert_records_are_fsdps_own(model)

    # Explicit prefetch: layer i gathers layer i+1's units ahead in forward (depth 1) and
    # layers i-1, i-2 in backward (depth 2).
    def prefetch(i, kind):
        return prefetch_of(model, i, kind)

    assert prefetch(0, "forward") == ["model.layers.1", "model.layers.1.linear_attn._fp32_params"]
    assert prefetch(3, "backward") == ["model.layers.2", "model.layers.1", "model.layers.1.linear_attn._fp32_params"]
    # The chain's ends: the embedding gathers layer 0 ahead, the last layer the tail; in
    # backward the tail gathers the last two layers, layer 0 the embedding.
    assert prefetch(5, "forward") == ["model.norm"]
    assert prefetch(0, "backward") == ["model.embed_tokens"]
    assert prefetch_of(model, model.model.embed_tokens, "forward") == ["model.layers.0", "model.layers.0.linear_attn._fp32_params"]
    assert prefetch_of(model, model.lm_head, "backward") == ["model.layers.5", "model.layers.4", "model.layers.4.linear_attn._fp32_params"]

    # On CPU the all-gathers are asynchronous: entering layer 0 (after FSDP2's own
    # pre-forward: its hook is prepended) layer 1's prefetched all-gather is still an
    # outstanding work handle, not a finished blocking call.
    groups = [record.modules[0]._get_fsdp_state()._fsdp_param_group for _, record in fsdp_units(model)]
    assert groups and all(g.unshard_async_op for g in groups)
    pending = {}

    def check_prefetch(module, args):
        result = model.model.layers[1]._get_fsdp_state()._fsdp_param_group._all_gather_result
        pending["layer 1"] = result is not None and result.all_gather_work is not None

    handle = model.model.layers[0].register_forward_pre_hook(check_prefetch)
    model(**random_batch(2, 16, model.config.vocab_size, seed=rank))
    handle.remove()
    assert pending == {"layer 1": True}, pending

    # The holders' gradients are reduced at the end of backward, not mid-way through their
    # layer's (GateInput): when the backward reaches a layer's input norm (its GatedDeltaNet
    # done), the holder's sharded gradient does not exist yet; after backward it does.
    def sharded_grad(i):
        holder = model.model.layers[i].linear_attn._fp32_params
        return holder._get_fsdp_state()._fsdp_param_group.fsdp_params[0].sharded_param.grad

    seen = {}

    def record(i):
        def hook(module, grad_output):
            seen[i] = sharded_grad(i) is None

        return hook

    for i in gdn_layers:
        model.model.layers[i].input_layernorm.register_full_backward_pre_hook(record(i))
    batch = random_batch(2, 16, model.config.vocab_size, seed=rank)
    model(**batch).loss.backward()
    assert seen == dict.fromkeys(gdn_layers, True), seen
    assert all(sharded_grad(i) is not None for i in gdn_layers)

    # fp32_holder_units="model": one fp32 unit for every holder, out of the layer units
    # and the prefetch lists; its gradients are reduced at the end of backward too.
    shared = PARALLELIZER.apply(build_tiny_causal_lm(num_hidden_layers=6), mesh, mp_policy=policy, fp32_holder_units="model")
    rows = {row["unit"]: row for row in describe_units(shared)}
    holders = "+".join(f"model.layers.{i}.linear_attn._fp32_params" for i in gdn_layers)
    assert set(rows) == {"model.embed_tokens", "model.norm+lm_head", holders} | {f"model.layers.{i}" for i in range(6)}
    assert (rows[holders]["compute"], rows[holders]["params"]) == ("float32", 2 * 4 * len(gdn_layers))
    assert rows["model.layers.0"]["params"] == units["model.layers.0"]["params"]
    assert_records_are_fsdps_own(shared)
    assert prefetch_of(shared, 0, "forward") == ["model.layers.1"]
    assert prefetch_of(shared, shared.model.embed_tokens, "forward") == ["model.layers.0", "model.layers.0.linear_attn._fp32_params"]
    group = shared.model.layers[0].linear_attn._fp32_params._get_fsdp_state()._fsdp_param_group
    shared(**batch).loss.backward()
    assert all(fp.sharded_param.grad is not None for fp in group.fsdp_params)
    with pytest.raises(ValueError, match=r"fp32_holder_units='layer'; expected one of \('per_layer', 'model'\)"):
        PARALLELIZER.apply(build_tiny_causal_lm(), mesh, fp32_holder_units="layer")

    off = PARALLELIZER.apply(build_tiny_causal_lm(num_hidden_layers=6), mesh, enable_fsdp2_prefetch=False)
    assert off.model.layers[0]._get_fsdp_state()._states_to_forward_prefetch == []

    # Tied embeddings: one unit owns the shared weight (the tail, with the embedding first).
    tied = PARALLELIZER.apply(build_tiny_causal_lm(tie_word_embeddings=True), mesh)
    names = [row["unit"] for row in describe_units(tied)]
    assert "model.embed_tokens+model.norm+lm_head" in names and "model.embed_tokens" not in names
    assert_records_are_fsdps_own(tied)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert isinstance(tied.lm_head, FSDPModule)
    last = f"model.layers.{len(tied.model.layers) - 1}"
    assert prefetch_of(tied, tied.lm_head, "forward")[:1] == ["model.layers.0"]
    assert prefetch_of(tied, tied.lm_head, "backward")[:1] == [last]


def test_units_are_dtype_uniform_and_prefetch_follows_layer_order():
    run_world(_units_worker, 2)
