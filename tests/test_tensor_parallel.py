"""Head-parallel TP under PARALLELIZER.apply equals the single-process Transformers model
(fp32: loss and every gathered gradient at every step, through AdamW steps)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_world
from _parity import assert_close, hf_name

pytestmark = pytest.mark.multiprocess

STEPS = 3


def mesh_for(world: int, dp: int, cp: int, tp: int):
    mesh = init_device_mesh("cpu", (1, dp, cp, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def _tp_worker(rank: int, world: int, dp: int, cp: int, tp: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.tensor_parallel import clip_grad_norm_, gather_tensor_parallel
    from qwen35_accel.parallelization import mesh_dim_names
    from qwen35_accel.tiny import build_tiny_causal_lm, random_batch

    reference = build_tiny_causal_lm(seed=0)
    model = build_tiny_causal_lm(seed=0)
    config = model.config
    # GQA in both token mixers, and tp divides every head count.
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.linear_num_key_heads < config.linear_num_value_heads
    mesh = mesh_for(world, dp, cp, tp)
    PARALLELIZER.apply(model, mesh)

    # Each rank's GatedDeltaNet recurrence runs on its value heads only: the decay gate
    # (one value per value head and token) and the projections are local.
    seen = []
    for layer in model.model.layers:
        if layer.block_type == "linear_attention":
            layer.linear_attn._fp32_params.register_forward_hook(lambda m, a, out: seen.append(out.shape[-1]))
    gdn = model.model.layers[0].linear_attn
    assert gdn.num_v_heads == config.linear_num_value_heads // tp and gdn.num_k_heads == config.linear_num_key_heads // tp

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = mesh_dim_names(mesh)
    replica = mesh["dp_shard"].get_local_rank() if "dp_shard" in names and dp > 1 else 0
    ref_params = dict(reference.named_parameters())
    for step in range(STEPS):
        batch = random_batch(2 * dp, 16, config.vocab_size, seed=10 + step)
        local = {k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}
        if cp > 1:
            local = shard_batch(local, mesh["cp"])
        loss = model(**local).loss
        loss.backward()
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        reported = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(reported, op=dist.ReduceOp.AVG, group=mesh["dp_shard"].get_group())
        assert_close(reported, ref_loss.detach(), f"loss at step {step}")
        checked = 0
        for name, p in model.named_parameters():
            full = gather_tensor_parallel(model, name, p.grad)
            assert_close(full, ref_params[hf_name(name)].grad, f"grad of {name} at step {step}")
            checked += 1
        assert checked == len(ref_params)
        if step == STEPS - 1:  # clipping sees the whole model's gradient on every rank
            total = clip_grad_norm_(model, 0.05)
            ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            assert ref_total > 0.05 and total > 0.05
            assert_close(total, ref_total, "gradient norm")
            for name, p in model.named_parameters():
                assert_close(gather_tensor_parallel(model, name, p.grad), ref_params[hf_name(name)].grad, f"clipped {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert set(seen) == {config.linear_num_value_heads // tp}

    # The gathered state dict is the Transformers one: keys, layouts (fused in_proj_qkv
    # rows in their original order), values.
    state = model.state_dict()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}
    expected = reference.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert_close(state[key], value, f"state_dict[{key}]", atol=1e-5)  # AdamW: see test_fsdp_parity


@pytest.mark.parametrize(
    "world,dp,cp,tp",
    [(2, 1, 1, 2), (4, 2, 1, 2), (4, 1, 2, 2), (8, 2, 2, 2)],
    ids=["tp2", "dp2xtp2", "cp2xtp2", "dp2xcp2xtp2"],
)
def test_tp_matches_single_process_through_adamw_steps(world, dp, cp, tp):
    run_world(_tp_worker, world, dp, cp, tp)


def _checkpoint_worker(rank: int, world: int, tmp: str) -> None:
    from transformers import AutoModelForCausalLM

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.tiny import build_tiny_causal_lm, random_batch

    # An unmodified checkpoint loads into a TP model (each rank keeps its slice)...
    source = build_tiny_causal_lm(seed=1)
    model = build_tiny_causal_lm(seed=0)
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.parallel.tensor_parallel import apply_tensor_parallel

    install_fp32_gate(model)
    apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    model.load_state_dict(source.state_dict())
    batch = random_batch(2, 16, source.config.vocab_size, seed=0)
    assert_close(model(**batch).logits, source(**batch).logits, "logits after loading")
    # ... and its gathered state dict saves as one that from_pretrained loads.
    state = model.state_dict()
    if rank == 0:
        source.save_pretrained(tmp, state_dict=dict(state))
    dist.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(tmp)
    assert_close(loaded(**batch).logits, source(**batch).logits, "logits after from_pretrained")
    assert loaded.model.layers[0].linear_attn.A_log.dtype == torch.float32
    del PARALLELIZER


def test_tp_checkpoints_are_transformers_checkpoints(tmp_path):
    run_world(_checkpoint_worker, 2, str(tmp_path))


def _bad_tp_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(num_attention_heads=3, num_key_value_heads=1, linear_num_value_heads=6,
                                 linear_num_key_heads=3)
    with pytest.raises(
        ValueError,
        match=r"tp size 2 must divide num_attention_heads = 3, num_key_value_heads = 1, linear_num_key_heads = 3",
    ):
        PARALLELIZER.apply(model, mesh_for(world, 1, 1, 2))
    assert "A_log" in model.model.layers[0].linear_attn._parameters  # refused before any change


def test_tp_refuses_head_counts_it_cannot_split():
    run_world(_bad_tp_worker, 2)
