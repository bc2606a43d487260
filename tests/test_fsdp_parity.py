"""FSDP2 under PARALLELIZER.apply equals the single-process Transformers model (fp32).

Through optimizer steps, what is exact is compared: the loss and every gradient before the
optimizer acts, and the weights after SGD with momentum (sharded optimizer state), whose
difference is lr times the gradients' (reduction-order) differences.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from _dist import run_world
from _parity import assert_close, assert_grads_match, assert_params_match

pytestmark = pytest.mark.multiprocess

BATCH_PER_RANK, SEQ, STEPS = 2, 32, 3


def accelerate_style_mesh(world_size: int, dp_replicate: int = 1):
    """The mesh Accelerate's ParallelismConfig builds: dims + flattened dp_shard_cp."""
    dp_shard = world_size // dp_replicate
    mesh = init_device_mesh("cpu", (dp_replicate, dp_shard, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def _parity_worker(rank: int, world: int, tie: bool, dp_replicate: int, holder_units: str = "per_layer",
                   activation_checkpointing: bool = False) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    reference = build_tiny_causal_lm(seed=0, tie_word_embeddings=tie)
    model = build_tiny_causal_lm(seed=0, tie_word_embeddings=tie)
    # 3 layers: 2 GatedDeltaNet + 1 full attention, GQA in both, partial rotary.
    assert [l.block_type for l in model.model.layers].count("linear_attention") >= 2
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config.linear_num_key_heads < model.config.linear_num_value_heads
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie

    PARALLELIZER.apply(model, accelerate_style_mesh(world, dp_replicate), fp32_holder_units=holder_units,
                       activation_checkpointing=activation_checkpointing)
    # lr 1: steps of a tenth of the weights (|grad| ~ 1e-3, |weight| ~ 1e-2), so that an
    # update 1e-3 off (wrong gradient or momentum) shows in the weights at rtol 1e-5.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1.0, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)

    for step in range(STEPS + 1):
        batch = random_batch(BATCH_PER_RANK * world, SEQ, reference.config.vocab_size, seed=100 + step)
        local = {k: v[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for k, v in batch.items()}
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        loss = model(**local).loss
        loss.backward()
        # Every row has the same token count: the global mean is the mean of rank means,
        # and FSDP2's gradient average is the gradient of that mean.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        assert_close(global_loss, ref_loss.detach(), f"loss at step {step}")
        assert_grads_match(model, reference)
        if step == STEPS:
            break
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        # fp32 rtol 1e-5 / atol 1e-6: the weights differ by lr x the momentum-summed gradient
        # differences above (rtol 1e-5), far below the weights' own size.
        assert_params_match(model, reference)


@pytest.mark.parametrize(
    "world,tie,dp_replicate",
    # world2-tied in the fast tier (untied FSDP2 parity there: test_accelerate_plugin's dp2)
    [pytest.param(2, False, 1, marks=pytest.mark.slow), (2, True, 1), pytest.param(4, False, 1, marks=pytest.mark.slow), pytest.param(4, True, 2, marks=pytest.mark.slow)],
    ids=["world2-untied", "world2-tied", "world4-untied", "world4-tied-hsdp2x2"],
)
def test_loss_grads_and_weights_match_single_process_through_sgd_momentum_steps(world: int, tie: bool, dp_replicate: int) -> None:
    run_world(_parity_worker, world, tie, dp_replicate)


def test_one_fp32_unit_for_all_gate_holders_matches_single_process_also_with_checkpointing() -> None:
    run_world(_parity_worker, 2, False, 1, "model", True)


def _partly_frozen_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    def frozen(model):
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[1].mlp.requires_grad_(False)
        model.model.layers[0].linear_attn.A_log.requires_grad_(False)  # one gate parameter only
        return model

    reference = frozen(build_tiny_causal_lm(seed=0))
    model = PARALLELIZER.apply(frozen(build_tiny_causal_lm(seed=0)), accelerate_style_mesh(world))
    batch = random_batch(BATCH_PER_RANK * world, SEQ, reference.config.vocab_size, seed=5)
    local = {k: v[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for k, v in batch.items()}
    reference(**batch).loss.backward()
    model(**local).loss.backward()
    assert not model.model.layers[0].linear_attn.A_log.requires_grad
    assert assert_grads_match(model, reference) == sum(p.requires_grad for p in reference.parameters())


def test_partly_frozen_model_matches_single_process():
    run_world(_partly_frozen_worker, 2)


def _mixed_storage_worker(rank: int, world: int) -> None:
    from torch.distributed.fsdp import FSDPModule

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.fsdp import fully_shard_by_dtype
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    # A bf16 model whose norms stay fp32 (as some checkpoints do): each fp32 norm
    # subtree becomes a unit of its own, the rest of the layer stays one bf16 unit.
    model = build_tiny_causal_lm(seed=0, dtype=torch.bfloat16)
    for layer in model.model.layers:
        layer.input_layernorm.float()
        layer.post_attention_layernorm.float()
    model.model.norm.float()  # the final norm too: the tail splits into norm and lm_head units
    mesh = accelerate_style_mesh(world)
    PARALLELIZER.apply(model, mesh)
    layer = model.model.layers[0]
    assert isinstance(layer, FSDPModule) and isinstance(layer.input_layernorm, FSDPModule)
    assert isinstance(layer.linear_attn._fp32_params, FSDPModule) and not isinstance(layer.mlp, FSDPModule)
    norm_group = model.model.norm._get_fsdp_state()._fsdp_param_group
    assert norm_group is not model.lm_head._get_fsdp_state()._fsdp_param_group
    loss = model(**random_batch(2, 16, model.config.vocab_size, seed=rank)).loss
    loss.backward()
    assert torch.isfinite(loss)

    # A minority-dtype parameter held directly beside others cannot be isolated.
    norm = build_tiny_causal_lm(seed=0, dtype=torch.bfloat16).model.layers[0].input_layernorm
    norm.scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"Qwen3_5RMSNorm\.scale is a trainable torch\.float32 parameter .* torch\.bfloat16"):
        fully_shard_by_dtype(norm, mesh=mesh["dp_shard_cp"], mp_policy=MixedPrecisionPolicy())


def test_mixed_storage_subtrees_become_separate_units_and_unsplittable_mix_raises():
    run_world(_mixed_storage_worker, 2)


def _accumulation_worker(rank: int, world: int, holder_units: str) -> None:
    """Gradient accumulation (no reduction on the first micro-batch, as Accelerate's
    `accumulate` does): the gate holders, reduced at the end of backward, still come out
    with the gradient of both micro-batches."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    reference = build_tiny_causal_lm(seed=0)
    model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), accelerate_style_mesh(world), fp32_holder_units=holder_units)
    for micro in range(2):
        batch = random_batch(BATCH_PER_RANK * world, SEQ, reference.config.vocab_size, seed=200 + micro)
        local = {k: v[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for k, v in batch.items()}
        model.set_requires_gradient_sync(micro == 1)
        model(**local).loss.backward()
        reference(**batch).loss.backward()
    assert_grads_match(model, reference)


@pytest.mark.parametrize("holder_units", ["per_layer", pytest.param("model", marks=pytest.mark.slow)])  # "model": also in the test above
def test_gradient_accumulation_without_sync_matches_single_process(holder_units: str) -> None:
    run_world(_accumulation_worker, 2, holder_units)
