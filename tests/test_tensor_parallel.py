"""Head-parallel TP under PARALLELIZER.apply equals the single-process Transformers model
(fp32: loss and every gathered gradient at every step before AdamW acts; the weights after
AdamW within the bound derived from both runs' gradients, `_parity.AdamWeightTolerance`)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_world
from _parity import AdamWeightTolerance, assert_close, eval_logits, hf_name

pytestmark = pytest.mark.multiprocess

STEPS = 3


def mesh_for(world: int, dp: int, cp: int, tp: int):
    mesh = init_device_mesh("cpu", (1, dp, cp, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def _tp_worker(rank: int, world: int, dp: int, cp: int, tp: int, vocab_parallel: bool = False) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.tensor_parallel import clip_grad_norm_, gather_tensor_parallel, tensor_parallel_numel_elsewhere
    from qwen35_accel.parallelization import mesh_dim_names
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    reference = build_tiny_causal_lm(seed=0)
    model = build_tiny_causal_lm(seed=0)
    config = model.config
    # GQA in both token mixers, and tp divides every head count.
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.linear_num_key_heads < config.linear_num_value_heads
    mesh = mesh_for(world, dp, cp, tp)
    PARALLELIZER.apply(model, mesh, vocab_parallel_lm_head=vocab_parallel)
    # This rank's parameter count (FSDP2's DTensors span dp) and the other tp ranks' slices
    # of the split ones: the unsplit model's (the Trainer's total_flos counts with it).
    assert model.num_parameters() + tensor_parallel_numel_elsewhere(model) == reference.num_parameters()

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
    adam = AdamWeightTolerance(lr=1e-3)
    names = mesh_dim_names(mesh)
    replica = mesh["dp_shard"].get_local_rank() if "dp_shard" in names and dp > 1 else 0
    ref_params = dict(reference.named_parameters())
    for step in range(STEPS):
        batch = random_batch(2 * dp, 16, config.vocab_size, seed=10 + step)
        local = {k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}
        if cp > 1:
            local = shard_batch(local, mesh["cp"])
        if vocab_parallel:  # logits of an eval forward (before the training one): this rank's vocab slice
            logits = eval_logits(model, local)
            assert logits.shape[-1] == config.vocab_size // tp
            if cp == 1:
                from qwen35_accel.parallel.tensor_parallel import gather_vocab_parallel_logits

                want = reference(**local).logits.detach()
                assert_close(gather_vocab_parallel_logits(model, logits), want, "gathered logits")
        out = model(**local)
        loss = out.loss
        loss.backward()
        assert out.logits is None  # the tiled loss: no [tokens, vocab] in a training forward
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
            inf = clip_grad_norm_(model, 1e9, float("inf"))  # a bound nothing reaches: no scaling
            assert_close(inf, torch.stack([p.grad.abs().max() for p in reference.parameters()]).max(), "max-norm")
            total = clip_grad_norm_(model, 0.05)
            ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            assert ref_total > 0.05 and total > 0.05
            assert_close(total, ref_total, "gradient norm")
            for name, p in model.named_parameters():
                assert_close(gather_tensor_parallel(model, name, p.grad), ref_params[hf_name(name)].grad, f"clipped {name}")
        for name, p in model.named_parameters():  # the gradients AdamW is about to use
            adam.step(hf_name(name), gather_tensor_parallel(model, name, p.grad), ref_params[hf_name(name)].grad)
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
    assert set(state) == set(expected) and set(expected) == set(ref_params)  # untied: one key per parameter
    for key, value in expected.items():
        adam.assert_close(state[key], value, key, f"state_dict[{key}]")


@pytest.mark.parametrize(
    "world,dp,cp,tp,vocab_parallel",
    # tp2 in the fast tier; worlds of 4 and 8 are slow.
    [(2, 1, 1, 2, False), pytest.param(4, 2, 1, 2, False, marks=pytest.mark.slow), pytest.param(4, 1, 2, 2, False, marks=pytest.mark.slow),
     pytest.param(8, 2, 2, 2, False, marks=pytest.mark.slow), pytest.param(4, 2, 1, 2, True, marks=pytest.mark.slow), pytest.param(4, 1, 2, 2, True, marks=pytest.mark.slow)],
    ids=["tp2", "dp2xtp2", "cp2xtp2", "dp2xcp2xtp2", "dp2xtp2-vocab-parallel", "cp2xtp2-vocab-parallel"],
)
def test_tp_matches_single_process_through_adamw_steps(world, dp, cp, tp, vocab_parallel):
    run_world(_tp_worker, world, dp, cp, tp, vocab_parallel)


def _checkpoint_worker(rank: int, world: int, tmp: str) -> None:
    from transformers import AutoModelForCausalLM

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

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
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(num_attention_heads=3, num_key_value_heads=1, linear_num_value_heads=6,
                                 linear_num_key_heads=3)
    with pytest.raises(
        ValueError,
        match=r"tp size 2 must divide num_attention_heads = 3, num_key_value_heads = 1, linear_num_key_heads = 3",
    ):
        PARALLELIZER.apply(model, mesh_for(world, 1, 1, 2))
    assert "A_log" in model.model.layers[0].linear_attn._parameters  # refused before any change
    with pytest.raises(ValueError, match=r"vocab-parallel lm_head needs untied embeddings"):
        PARALLELIZER.apply(build_tiny_causal_lm(tie_word_embeddings=True), mesh_for(world, 1, 1, 2),
                           vocab_parallel_lm_head=True)
    with pytest.raises(ValueError, match=r"needs tp size 2 to divide the vocab size 95"):
        PARALLELIZER.apply(build_tiny_causal_lm(vocab_size=95), mesh_for(world, 1, 1, 2), vocab_parallel_lm_head=True)
    # FSDP2's CPU offload: the TP norm, state dicts and loads would give NCCL CPU tensors.
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = build_tiny_causal_lm()
    with pytest.raises(NotImplementedError, match=r"FSDP2's CPU offload \(fsdp_offload_params: true, CPUOffloadPolicy\) with tensor parallelism \(tp size 2\)"):
        PARALLELIZER.apply(model, mesh_for(world, 1, 1, 2), offload_policy=CPUOffloadPolicy())
    assert "A_log" in model.model.layers[0].linear_attn._parameters  # refused before any change
    # Trainable parameters on several meshes: Transformers' Trainer would take its per-mesh norm, not the TP norm.
    from qwen35_accel.parallel.tensor_parallel.clipping import check_one_gradient_mesh

    model = PARALLELIZER.apply(build_tiny_causal_lm(), mesh_for(world, 1, 1, 2))
    check_one_gradient_mesh(model)  # the plugin's layout: one mesh
    model.model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match=r"found 2: plain tensors: 1 parameters \(e.g. model.extra\); mesh \{'dp_shard_cp': 1\}"):
        check_one_gradient_mesh(model)


def test_tp_refuses_head_counts_it_cannot_split_and_cpu_offload():
    run_world(_bad_tp_worker, 2)


def _train_step(model, opt, batch, replica: int, per_rank: int, grads: list | None = None) -> torch.Tensor:
    """One AdamW step; `grads` (if given) gets {Transformers name: gathered gradient} before AdamW acts."""
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel

    local = {k: v[per_rank * replica : per_rank * (replica + 1)] for k, v in batch.items()}
    loss = model(**local).loss
    loss.backward()
    if grads is not None:
        grads.append({hf_name(name): gather_tensor_parallel(model, name, p.grad) for name, p in model.named_parameters()})
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _resume_worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.model.state import find_state
    from qwen35_accel.parallel.tensor_parallel import _state_dict_shapes_only, load_full_state_dict, register_optimizer_state_layout
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    def build(dp: int, tp: int, seed: int):
        mesh = mesh_for(world, dp, 1, tp)
        model = PARALLELIZER.apply(build_tiny_causal_lm(seed=seed), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):  # idempotent: hooks installed once (twice would convert the state twice)
            register_optimizer_state_layout(model, opt)
        assert list(find_state(model).tp_optimizers) == [opt]
        return model, opt, mesh["dp_shard"].get_local_rank()

    batches = [random_batch(4, 16, 96, seed=20 + step) for step in range(4)]
    model, opt, replica = build(2, 2, seed=0)  # dp 2 x tp 2
    reference = build_tiny_causal_lm(seed=0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _train_step(model, opt, batches[0], replica, 2)
    _train_step(reference, ref_opt, batches[0], 0, 4)

    # Full optimizer state: Transformers layout, equal to the single-process optimizer's
    # (after one step: later, AdamW turns noise-level gradient differences into lr-sized ones).
    full = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True)
    full_optim = get_optimizer_state_dict(model, opt, options=full)
    ref_state = {name: ref_opt.state[p] for name, p in reference.named_parameters()}
    if rank == 0:
        assert set(full_optim["state"]) == set(ref_state)
        for name, state in full_optim["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert_close(state[key], ref_state[name][key], f"optimizer {name}.{key}")

    _train_step(model, opt, batches[1], replica, 2)
    # Copies: the state dicts share the optimizer's live `step` tensors, which go on counting.
    full_model = copy.deepcopy(get_model_state_dict(model, options=full))
    full_optim = copy.deepcopy(get_optimizer_state_dict(model, opt, options=full))
    resumed_from = copy.deepcopy(full_optim.get("state", {}))  # AdamW's state (on rank 0), for the weights' bound

    # Sharded (DCP) checkpoint of model and optimizer.
    sharded_dir = f"{tmp}/sharded"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=sharded_dir)

    expected_grads: list[dict[str, torch.Tensor]] = []
    expected = [_train_step(model, opt, batches[step], replica, 2, expected_grads) for step in (2, 3)]
    final = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}

    def check_resumed(resumed, resumed_opt, resumed_replica, per_rank, what, same_layout):
        # Same layout: one reduction order, the checkpoint round trip is exact (rtol 1e-6 for
        # safety). Another layout: fp32 rtol 1e-5 (reduction order) on the losses and on every
        # gradient before AdamW acts; the weights within the bound derived from those gradients.
        rtol = 1e-6 if same_layout else 1e-5
        grads: list[dict[str, torch.Tensor]] = []
        for i, step in enumerate((2, 3)):
            loss = _train_step(resumed, resumed_opt, batches[step], resumed_replica, per_rank, None if same_layout else grads)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            want = expected[i].clone()
            dist.all_reduce(want, op=dist.ReduceOp.AVG)
            assert_close(loss, want, f"{what}: loss at step {step}", rtol=rtol)
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in resumed.state_dict().items()}
        if same_layout:
            for key, value in final.items():
                assert_close(state[key], value, f"{what}: {key} after resuming", rtol=rtol, atol=1e-6)
            return
        adam = AdamWeightTolerance(lr=1e-2, start=resumed_from)
        for step, got, want in zip((2, 3), grads, expected_grads):
            for name, grad in want.items():
                assert_close(got[name], grad, f"{what}: grad of {name} at step {step}")
                adam.step(name, got[name], grad)
        if rank == 0:  # where `resumed_from` holds the state
            for key, value in final.items():
                adam.assert_close(state[key], value, key, f"{what}: {key} after resuming")

    def load_sharded(dp, tp, seed):
        resumed, resumed_opt, resumed_replica = build(dp, tp, seed)
        state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_opt)}
        dcp.load(state, checkpoint_id=sharded_dir)
        set_model_state_dict(resumed, state["model"])
        set_optimizer_state_dict(resumed, resumed_opt, state["optim"])
        return resumed, resumed_opt, resumed_replica

    # 1. Same layout, from the sharded checkpoint (what Accelerate's SHARDED_STATE_DICT does).
    resumed, resumed_opt, _ = load_sharded(2, 2, seed=5)
    check_resumed(resumed, resumed_opt, replica, 2, "sharded", same_layout=True)

    # 2. Same layout, from full state dicts on rank 0 (FULL_STATE_DICT checkpoints).
    resumed, resumed_opt, _ = build(2, 2, seed=6)
    load_full_state_dict(resumed, full_model if rank == 0 else None)
    set_optimizer_state_dict(resumed, resumed_opt, full_optim if rank == 0 else {}, options=full)
    check_resumed(resumed, resumed_opt, replica, 2, "full", same_layout=True)

    # 3. The checkpoint does not depend on the tp size: resume the sharded one at dp 4, tp 1.
    resumed, resumed_opt, replica4 = load_sharded(4, 1, seed=7)
    check_resumed(resumed, resumed_opt, replica4, 1, "tp 2 -> tp 1", same_layout=False)

    # Wrong shapes are named, on every rank; split tensors are checked against their
    # Transformers shape, which load_full_state_dict learns without gathering them.
    with pytest.raises(ValueError, match=r"shapes \['model.embed_tokens.weight: \[95, 32\]"):
        broken = dict(full_model) if rank == 0 else None
        if rank == 0:
            broken["model.embed_tokens.weight"] = broken["model.embed_tokens.weight"][:95]
        load_full_state_dict(resumed, broken)
    qkv = "model.layers.0.linear_attn.in_proj_qkv.weight"
    resumed, _, _ = build(2, 2, seed=8)
    with _state_dict_shapes_only():
        described = resumed.state_dict()
    gathered = resumed.state_dict()
    assert list(described) == list(gathered)
    assert {k: tuple(v.shape) for k, v in described.items()} == {k: tuple(v.shape) for k, v in gathered.items()}
    assert described[qkv].is_meta and not gathered[qkv].is_meta
    rows = gathered[qkv].shape[0]
    with pytest.raises(ValueError, match=rf"shapes \['{qkv}: \[{rows // 2}, 32\] \(model \[{rows}, 32\]\)"):
        broken = dict(full_model) if rank == 0 else None
        if rank == 0:
            broken[qkv] = broken[qkv][: rows // 2]
        load_full_state_dict(resumed, broken)


@pytest.mark.slow  # world 4
def test_tp_checkpoints_resume_sharded_full_and_at_another_tp_size(tmp_path):
    run_world(_resume_worker, 4, str(tmp_path))
