"""PEFT LoRA on a dense Qwen3.5 under PARALLELIZER.apply equals the single-process PEFT model.

The reference is `get_peft_model(unmodified Transformers model, LoraConfig(all-linear))` in one
process; the parallel model is built the same way from the same seeds, then parallelized.
Adapters are initialised randomly (`init_lora_weights=False`): with PEFT's default zero
`lora_B`, every `lora_A` gradient would be zero and a wrong one could not show.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from _dist import run_world
from _parity import assert_close, assert_grads_match, full
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

pytestmark = pytest.mark.multiprocess

ROWS_PER_REPLICA, SEQ = 2, 32
GATE = ("A_log", "dt_bias")


def lora_model(dtype: torch.dtype = torch.float32):
    """The tiny model with LoRA adapters on every linear layer but the lm_head (fp32 adapters,
    frozen base of `dtype`)."""
    from peft import LoraConfig, get_peft_model

    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    base = build_tiny_causal_lm(seed=0, dtype=dtype)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.0)
    return get_peft_model(base, config, autocast_adapter_dtype=True)


def lora_moe(num_experts: int = 6):
    """All-linear LoRA (the mixers, the shared expert and its gate) on the tiny MoE."""
    from peft import LoraConfig, get_peft_model

    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

    base = build_tiny_moe_causal_lm(seed=0, num_experts=num_experts)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.0)
    return get_peft_model(base, config, autocast_adapter_dtype=True)


def mesh_of(world: int, cp: int):
    mesh = init_device_mesh("cpu", (1, world // cp, cp, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def backward_and_check_loss(model, reference, mesh, *, dp: int, cp: int) -> None:
    """One forward/backward of both models on the same global batch (this rank: its replica's
    rows, its cp chunks); the loss averaged over the replicas equals the reference's."""
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import random_batch

    batch = random_batch(ROWS_PER_REPLICA * dp, SEQ, reference.config.vocab_size, seed=7)
    replica = mesh["dp_shard"].get_local_rank()
    local = {k: v[replica * ROWS_PER_REPLICA : (replica + 1) * ROWS_PER_REPLICA] for k, v in batch.items()}
    if cp > 1:
        local = shard_batch(local, mesh["cp"])
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    loss = model(**local).loss
    loss.backward()
    # Every rank reports its cp group's mean; the replicas hold equal token counts.
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp_shard"].get_group())
    assert_close(loss, ref_loss.detach(), "loss")


def _lora_parity_worker(rank: int, world: int, cp: int, activation_checkpointing: bool) -> None:
    from qwen35_accel import PARALLELIZER

    reference, model = lora_model(), lora_model()
    targets = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
            "gate_proj", "up_proj", "down_proj"} <= targets, targets
    mesh = mesh_of(world, cp)
    PARALLELIZER.apply(model, mesh, activation_checkpointing=activation_checkpointing)

    backward_and_check_loss(model, reference, mesh, dp=world // cp, cp=cp)
    trainable = assert_grads_match(model, reference)  # frozen: no gradient; adapters: the reference's
    assert trainable == sum(p.requires_grad for p in reference.parameters()) > 0
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "world,cp,ac",
    [(2, 1, True), pytest.param(2, 2, False, marks=pytest.mark.slow), pytest.param(4, 2, True, marks=pytest.mark.slow)],
    ids=["fsdp2-ac", "cp2", "dp2xcp2-ac"],
)
def test_lora_loss_and_adapter_grads_match_single_process(world: int, cp: int, ac: bool) -> None:
    run_world(_lora_parity_worker, world, cp, ac)


def _lora_bf16_worker(rank: int, world: int) -> None:
    """bf16 policy on a bf16 base with fp32 adapters: units uniform among trainable
    parameters, every frozen gate holder its own fp32 unit gathering the fp32 values."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.model.fp32_gate import HOLDER_NAME
    from qwen35_accel.parallel.fsdp import fsdp_units
    from qwen35_accel.testing.tiny import random_batch

    model = lora_model(torch.bfloat16)
    base = model.get_base_model()
    masters = {}
    for layer in base.model.layers:
        if layer.block_type == "linear_attention":
            gdn = layer.linear_attn
            masters[id(gdn)] = {n: getattr(gdn, n).detach().float().clone() for n in GATE}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    PARALLELIZER.apply(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))

    units = fsdp_units(model)
    for names, record in units:
        trainable = {p.dtype for p in record.parameters() if p.requires_grad}
        assert len(trainable) <= 1, (names, trainable)
    holders = [record for names, record in units if names[0].endswith(HOLDER_NAME)]
    assert len(holders) == len(masters) and all(r.mp_policy.param_dtype == torch.float32 for r in holders)
    assert all(not p.requires_grad for r in holders for p in r.parameters())
    seen: list[tuple[torch.dtype, bool]] = []
    for layer in base.model.layers:
        if layer.block_type != "linear_attention":
            continue
        holder = getattr(layer.linear_attn, HOLDER_NAME)
        assert not any(p.requires_grad for p in holder.parameters())  # frozen by PEFT
        master = masters[id(layer.linear_attn)]

        def check(module, args, master=master):
            for n in GATE:
                p = getattr(module, n)
                seen.append((p.dtype, torch.equal(p.float(), master[n])))

        holder.register_forward_pre_hook(check)
    loss = model(**random_batch(2, SEQ, base.config.vocab_size, seed=rank)).loss
    loss.backward()
    assert seen and all(dtype == torch.float32 and equal for dtype, equal in seen), seen
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert "lora_" in name and p.dtype == torch.float32, name
            assert p.grad is not None and torch.isfinite(full(p.grad)).all(), name
        else:
            assert p.grad is None, name


@pytest.mark.slow  # fsdp2-ac and tp2 are the fast tier's LoRA tests
def test_lora_under_a_bf16_policy_keeps_frozen_gate_holders_in_fp32_units() -> None:
    run_world(_lora_bf16_worker, 2)


def test_detection_looks_through_peft_wrappers_only_around_dense_qwen35() -> None:
    from peft import LoraConfig, PromptTuningConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from qwen35_accel import is_dense_qwen35
    from qwen35_accel.model.detect import qwen35_parts, unwrap_qwen35
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    model = lora_model()
    assert is_dense_qwen35(model) and is_dense_qwen35(model.base_model)
    assert unwrap_qwen35(model) is model.get_base_model()
    assert qwen35_parts(model).decoder_layers[0] is model.get_base_model().model.layers[0]
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert not is_dense_qwen35(get_peft_model(llama, LoraConfig(target_modules="all-linear")))
    # Prompt learning puts no tuner layers into the model: not looked through (stock Accelerate).
    prompt = get_peft_model(build_tiny_causal_lm(seed=0), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert not is_dense_qwen35(prompt)


def _lora_tp_worker(rank: int, world: int, dp: int, cp: int, tp: int, ep: int = 1) -> None:
    """Adapters split with their base layer: loss, every adapter gradient (gathered into the
    Transformers/PEFT layout) and the gathered state dict equal the single-process PEFT model.
    `ep` > 1: on the tiny MoE (8 experts, all-linear adapters), ep × tp holding its frozen experts."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel

    build = partial(lora_moe, num_experts=8) if ep > 1 else lora_model
    reference, model = build(), build()
    mesh = init_device_mesh("cpu", (1, dp, cp, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    PARALLELIZER.apply(model, mesh, ep=ep)
    if ep > 1:
        assert model.get_base_model().model.layers[0].mlp.experts.num_experts == 8 // (ep * tp)
    qkv = model.get_base_model().model.layers[0].linear_attn.in_proj_qkv
    ref_qkv = reference.get_base_model().model.layers[0].linear_attn.in_proj_qkv
    # Row-split base: lora_B split like it, lora_A whole.
    assert qkv.lora_B["default"].weight.shape[0] * tp == ref_qkv.lora_B["default"].weight.shape[0]
    assert qkv.lora_A["default"].weight.shape == ref_qkv.lora_A["default"].weight.shape

    backward_and_check_loss(model, reference, mesh, dp=dp, cp=cp)
    ref = dict(reference.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name
            continue
        assert_close(gather_tensor_parallel(model, name, p.grad), ref[name].grad, f"grad of {name}")
        checked += 1
    assert checked == sum(p.requires_grad for p in reference.parameters()) > 0
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    expected = reference.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert_close(state[key], value, f"state_dict[{key}]")


@pytest.mark.parametrize("world,dp,cp,tp,ep", [(2, 1, 1, 2, 1), pytest.param(4, 1, 2, 2, 1, marks=pytest.mark.slow),
                                               pytest.param(4, 2, 1, 2, 2, marks=pytest.mark.slow)],
                         ids=["tp2", "cp2xtp2", "moe-ep2xtp2"])
def test_lora_under_tensor_parallelism_matches_single_process(world: int, dp: int, cp: int, tp: int, ep: int) -> None:
    run_world(_lora_tp_worker, world, dp, cp, tp, ep)
