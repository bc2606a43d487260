"""Qwen4-Exp (issue 61, first slice after docs/qwen4_exp_design.md): its GatedDeltaNet (Qwen3.5's) takes the
fp32 holder, its decoder layers (hyper-connections, PLE with its n-gram table, QSA, the MoE block) the
dtype-uniform FSDP2 units, its experts EP, its causal LM the tiled loss (its forward is Qwen3.5-MoE's); CP and
TP are refused on every rank until built. The oracle is the unmodified Transformers `Qwen4ExpForCausalLM` in
one process, on a tiny config built in code (fp32 rtol 1e-5: ranks sum in another order).

The QSA indexer's projection gets no gradient from the loss (its top-k selection is not differentiable),
in one process as under the plugin: the tests freeze it so that "every trainable parameter's gradient"
means the ones the loss reaches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from _parity import assert_grads_match
from qwen35_accel.model.detect import FAMILIES, qwen35_family, qwen35_parts
from qwen35_accel.model.fp32_gate import install_fp32_gate
from qwen35_accel.testing.tiny import build_tiny_qwen4_exp_causal_lm, random_batch


def build(seed: int = 0, **overrides):
    """The tiny Qwen4-Exp with its QSA indexers frozen (they get no gradient either way)."""
    model = build_tiny_qwen4_exp_causal_lm(seed=seed, **overrides)
    for name, param in model.named_parameters():
        if ".indexer." in name:
            param.requires_grad_(False)
    return model


def _batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    batch = random_batch(rows, 24, 96, seed=seed)
    ids = batch["input_ids"].clamp(min=2)  # no pad (0) or EOS (1): every n-gram segment runs the whole row
    return {"input_ids": ids, "labels": ids.clone()}


def test_its_gates_move_to_the_fp32_holder_and_it_computes_as_transformers_bitwise():
    reference = build()
    model = copy.deepcopy(reference)
    parts = qwen35_parts(model, families=FAMILIES)
    assert qwen35_family(model) == "qwen4" and parts.layer_types == ("linear_attention", "linear_attention", "indexed_attention")
    assert parts.final_norm is model.model.hyper_connection_mixer and len(parts.moe_blocks) == 3
    assert install_fp32_gate(model) == 2
    want, got = reference(**_batch(2, 1)), model(**_batch(2, 1))
    assert torch.equal(got.loss, want.loss)
    want.loss.backward()
    got.loss.backward()
    assert assert_grads_match(model, reference) == sum(p.requires_grad for p in reference.parameters())


def _fsdp_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.fsdp import describe_units
    from qwen35_accel.parallel.tiled_loss import tiled_loss_mode
    from test_cp_model import cp_mesh
    from test_fsdp_parity import accelerate_style_mesh

    for mesh in (cp_mesh(world, 1), accelerate_style_mesh(world, dp_replicate=world)):  # FSDP2, then HSDP
        reference = build(output_router_logits=True)
        model = copy.deepcopy(reference)
        PARALLELIZER.apply(model, mesh, activation_checkpointing=True)
        assert tiled_loss_mode(model) == "recompute"
        units = {row["unit"]: (row["storage"], row["compute"]) for row in describe_units(model)}
        assert units["model.layers.0.linear_attn._fp32_params"] == ("float32", "float32"), units
        assert "model.hyper_connection_mixer+lm_head" in units, units  # the tail: no final norm, the streams' mixer
        batch = _batch(4, 3)
        mine = {key: value[2 * rank: 2 * rank + 2] for key, value in batch.items()}
        got = model(**mine)
        with torch.no_grad():
            assert torch.allclose(got.loss, reference(**mine).loss, rtol=1e-5, atol=1e-6)
        # One process: the mean of the ranks' losses (the router's loss per rank's rows, stock's meaning under dp).
        (sum(reference(**{k: v[2 * r: 2 * r + 2] for k, v in batch.items()}).loss for r in range(world)) / world).backward()
        got.loss.backward()
        assert assert_grads_match(model, reference) > 0  # streams, PLE table, routers, experts, gates included
        dist.barrier()
    with pytest.raises(NotImplementedError, match=r"Qwen4-Exp .*here cp=2, tp=1\) .*docs/qwen4_exp_design.md"):
        PARALLELIZER.apply(build(), cp_mesh(world, world))  # every rank: the configuration decides
    dist.barrier()


@pytest.mark.multiprocess
def test_fsdp2_and_hsdp_with_fp32_gate_units_train_as_one_process_and_cp_is_refused():
    """dp 2 (FSDP2) and dp_replicate 2 (HSDP) with checkpointed layers: each rank's loss (cross entropy and
    the router's loss of its rows) and every gradient equal one process's."""
    run_world(_fsdp_worker, 2)


def _ep_worker(rank: int, world: int) -> None:
    from test_moe_ep import _parity

    _parity(rank, world, ep=2, cp=1, num_experts=6, build=build)


@pytest.mark.multiprocess
def test_ep2_routes_and_trains_as_one_process():
    """ep 2 over dp 2: each rank 3 of the 6 experts of every layer, tokens by all-to-all; every token's
    experts, the loss and every gradient through SGD steps equal one process's on each rank's rows."""
    run_world(_ep_worker, 2)
