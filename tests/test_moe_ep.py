"""Expert parallelism for Qwen3.5-MoE (issue 46, slice 4): `PARALLELIZER.apply(..., ep=N)`
against the unmodified model in one process — the loss with the router's loss, every gradient
(the experts gathered from their ep and efsdp shards), the experts every token was routed to —
through SGD steps, at ep 2 (world 2), ep 2 × cp 2, ep 2 with two copies of each expert
sharded by FSDP2, ep 4 and ep 2 under HSDP 2 × 2 (world 4); a full state dict gathered under ep loads into one
process bitwise; the layouts ep cannot take refused on every rank with the numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from _dist import run_world
from _parity import assert_close, assert_grads_match, full, hf_name
from test_moe import BATCH_PER_RANK, SEQ, _routing

pytestmark = pytest.mark.multiprocess
STEPS = 2


def _parity(rank: int, world: int, *, ep: int, cp: int, num_experts: int, activation_checkpointing: bool = False,
            dp_replicate: int = 1, tp: int = 1, activation_offload: bool = False, build=None):
    """`world` ranks, cp `cp`, the rest dp (`dp_replicate` of it replicas: HSDP); each dp rank's
    rows against one process on them (the router's loss per rank: stock's meaning under dp),
    `STEPS` SGD steps. Returns (model, reference). Also test_moe's FSDP2 parity (ep 1). `build`: the
    tiny model's builder (default `build_tiny_moe_causal_lm`)."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.context_parallel.chunks import unshard_sequence
    from qwen35_accel.parallel.tensor_parallel import clip_grad_norm_, gather_tensor_parallel
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, random_batch
    from test_cp_model import cp_mesh
    from test_fsdp_parity import accelerate_style_mesh
    from test_tensor_parallel import mesh_for

    build = build or build_tiny_moe_causal_lm  # or another MoE family's builder (Qwen3-Next)
    reference = build(seed=0, output_router_logits=True, num_experts=num_experts)
    model = build(seed=0, output_router_logits=True, num_experts=num_experts)
    if tp > 1:
        mesh = mesh_for(world, world // cp // tp, cp, tp)
    else:
        mesh = cp_mesh(world, cp) if dp_replicate == 1 else accelerate_style_mesh(world, dp_replicate=dp_replicate)
    PARALLELIZER.apply(model, mesh, ep=ep, activation_checkpointing=activation_checkpointing, activation_offload=activation_offload)
    experts = model.model.layers[0].mlp.experts
    assert experts.num_experts == num_experts // (ep * tp) and isinstance(experts.gate_up_proj, DTensor)
    weight = experts.gate_up_proj
    if ep > 1 and tp > 1:  # this tp rank's experts, a Shard(0) DTensor over the dense FSDP2 mesh, outside FSDP2
        dense = model.model.layers[0].input_layernorm.weight
        assert weight.device_mesh == dense.device_mesh and weight.placements == (Shard(0),), weight
        assert type(experts).__name__ == "Qwen3_5MoeExperts", "held experts are no FSDP2 unit"
    elif ep > 1:  # this rank's whole experts, a Shard(0) DTensor over ep (FSDP2 shards them over efsdp too)
        assert weight.device_mesh.mesh_dim_names[-1] == "ep" and weight.placements[-1].is_shard(0), weight
    ref_routes, _ = _routing(reference)
    routes, _ = _routing(model)
    dp = world // cp // tp
    replica = rank // (cp * tp)  # Accelerate's mesh order: (dp, cp, tp); a dp rank's cp and tp ranks share its rows
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1.0, momentum=0.9)
    for step in range(STEPS):
        batch = random_batch(BATCH_PER_RANK * dp, SEQ, reference.config.vocab_size, seed=100 + step)
        rows = [{k: v[r * BATCH_PER_RANK : (r + 1) * BATCH_PER_RANK] for k, v in batch.items()} for r in range(dp)]
        ref_routes.clear(), routes.clear()
        ref_losses = [reference(**part).loss for part in rows]
        (sum(ref_losses) / dp).backward()
        mine = rows[replica]
        got = model(**(shard_batch(mine, mesh["cp"]) if cp > 1 else mine))
        layers = len(routes)
        got.loss.backward()
        if activation_checkpointing:  # backward recomputed each layer, last first: the same routing
            recomputed = routes[layers:]
            assert len(recomputed) == layers and all(map(torch.equal, recomputed, routes[layers - 1 :: -1]))
            del routes[layers:]
        what = f"ep {ep} cp {cp} tp {tp}, rank {rank} step {step}"
        assert_close(got.loss.detach(), ref_losses[replica].detach(), f"{what}: loss")
        whole = ref_routes[replica * len(routes) : (replica + 1) * len(routes)]
        for layer, (chosen, want) in enumerate(zip(routes, whole)):
            if cp > 1:  # [rows · local seq, k] in chunk order: gathered over cp, in sequence order
                gathered = [torch.empty_like(chosen) for _ in range(cp)]
                dist.all_gather(gathered, chosen.contiguous(), group=mesh["cp"].get_group())
                chosen = unshard_sequence([g.reshape(BATCH_PER_RANK, -1, g.shape[-1]) for g in gathered], cp, seq_dim=1)
            assert torch.equal(chosen.reshape(want.shape), want), f"{what}: layer {layer} routed tokens to other experts"
        if tp > 1:  # the head-split parameters gathered to Transformers' layout (the experts are DTensors)
            ref_params = dict(reference.named_parameters())
            for name, p in model.named_parameters():
                assert_close(gather_tensor_parallel(model, name, p.grad), ref_params[hf_name(name)].grad, f"{what}: grad of {name}")
            # The TP gradient norm counts every piece of the experts (FSDP2's _StridedShard over the tp split).
            want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
            assert_close(clip_grad_norm_(model, 1e9), want, f"{what}: gradient norm")
        else:
            assert assert_grads_match(model, reference) > 0
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    return model, reference


def _world2(rank: int, world: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_moe_causal_lm
    from test_cp_model import cp_mesh
    from test_tensor_parallel import mesh_for

    model, reference = _parity(rank, world, ep=2, cp=1, num_experts=6, activation_checkpointing=True)
    # A full state dict gathered under ep 2 holds every expert whole, in Transformers' names, and
    # loads into one process bitwise.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert sorted(state) == sorted(reference.state_dict())
    params = {hf_name(name): full(p.detach()) for name, p in model.named_parameters()}
    one = build_tiny_moe_causal_lm(seed=1, output_router_logits=True)
    one.load_state_dict(state)
    for name, p in one.named_parameters():
        assert torch.equal(p, params[name]), f"{name} differs after the load"

    # Refused on every rank, before any change, with the numbers.
    with pytest.raises(ValueError, match=r"ep=4 does not divide the 2 ranks of dp_shard x cp"):
        PARALLELIZER.apply(build_tiny_moe_causal_lm(seed=0, num_experts=8), cp_mesh(world, 1), ep=4)
    with pytest.raises(ValueError, match=r"ep=2 does not divide the model's 5 experts per layer"):
        PARALLELIZER.apply(build_tiny_moe_causal_lm(seed=0, num_experts=5), cp_mesh(world, 1), ep=2)
    with pytest.raises(ValueError, match=r"expert parallelism needs a MoE model \(Qwen3.5-MoE, Qwen3-Next\); this one is dense"):
        PARALLELIZER.apply(build_tiny_causal_lm(seed=0), cp_mesh(world, 1), ep=2)
    with pytest.raises(ValueError, match=r"ep=2 does not divide the 1 ranks of dp_shard x cp .*\(world 2 = dp_replicate 1 "
                       r"x dp_shard x cp 1 x tp 2\)"):
        PARALLELIZER.apply(build_tiny_moe_causal_lm(seed=0), mesh_for(world, 1, 1, 2), ep=2)
    # GRPO/RLOO's patch points on a MoE model under cp: refused, where a dense model gets its replicas.
    from types import SimpleNamespace

    from qwen35_accel.integrations.trl.sampling import _applies

    under_cp = SimpleNamespace(torch_device_mesh=cp_mesh(world, 2))
    assert _applies(SimpleNamespace(model=build_tiny_causal_lm(seed=0), accelerator=under_cp)) is not None
    with pytest.raises(NotImplementedError, match=r"\(GRPO/RLOO\) on a Qwen3.5-MoE model under cp or tp is not built"):
        _applies(SimpleNamespace(model=build_tiny_moe_causal_lm(seed=0), accelerator=under_cp))
    with pytest.raises(NotImplementedError, match=r"a vocab-parallel lm_head is not built for the MoE models \(Qwen3.5-MoE, Qwen3-Next\)"):
        PARALLELIZER.apply(build_tiny_moe_causal_lm(seed=0), mesh_for(world, 1, 1, 2), vocab_parallel_lm_head=True)
    with pytest.raises(ValueError, match=r"tp size 2 must divide .*num_experts = 5"):
        PARALLELIZER.apply(build_tiny_moe_causal_lm(seed=0, num_experts=5), mesh_for(world, 1, 1, 2))
    dist.barrier()


def test_ep2_equals_one_process_with_the_same_routing_and_a_full_state_dict_loads_bitwise():
    run_world(_world2, 2)


def _world4(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm
    from test_tensor_parallel import mesh_for

    _parity(rank, world, ep=2, cp=2, num_experts=6)  # ep carved out of dp_shard × cp: the ep groups are cp groups
    _parity(rank, world, ep=2, cp=1, num_experts=6)  # two copies of each expert, FSDP2-sharded over them
    _parity(rank, world, ep=4, cp=1, num_experts=8)  # every rank its own 2 experts
    _parity(rank, world, ep=2, cp=1, num_experts=6, dp_replicate=2)  # HSDP 2 x 2: each replica an ep group
    _parity(rank, world, ep=1, cp=1, num_experts=6, tp=2)  # dp 2 x tp 2: the tp ranks split the experts whole
    _parity(rank, world, ep=1, cp=2, num_experts=6, tp=2)  # cp 2 x tp 2
    # ep x tp: each tp rank's experts split over the dp (or cp) ranks, outside FSDP2, one gradient mesh
    _parity(rank, world, ep=2, cp=1, num_experts=8, tp=2, activation_checkpointing=True)
    _parity(rank, world, ep=2, cp=2, num_experts=8, tp=2)
    _held_experts_compute_in_the_policys_dtype(rank, world)
    with pytest.raises(ValueError, match=r"ep=2 x tp 2 = 4 does not divide the model's 6 experts per layer"):
        PARALLELIZER.apply(build_tiny_moe_causal_lm(seed=0, num_experts=6), mesh_for(world, 2, 1, 2), ep=2)
    dist.barrier()


def _held_experts_compute_in_the_policys_dtype(rank: int, world: int) -> None:
    """ep 2 x tp 2 under a bf16 compute policy (fp32 storage, as Accelerate's FSDP2 mixed
    precision): the held experts, outside FSDP2, are cast as FSDP2 casts the rest (without it
    the experts' matmul meets bf16 tokens with fp32 weights); their gradients stay fp32 DTensors
    on the dense mesh, and the loss is the fp32 model's within bf16's rounding."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, random_batch
    from test_tensor_parallel import mesh_for

    reference = build_tiny_moe_causal_lm(seed=0, num_experts=8)
    model = build_tiny_moe_causal_lm(seed=0, num_experts=8)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    PARALLELIZER.apply(model, mesh_for(world, 2, 1, 2), ep=2, mp_policy=policy)
    batch = random_batch(BATCH_PER_RANK * 2, SEQ, reference.config.vocab_size, seed=7)
    mine = {k: v[rank // 2 * BATCH_PER_RANK : (rank // 2 + 1) * BATCH_PER_RANK] for k, v in batch.items()}
    loss = model(**mine).loss
    loss.backward()
    grad = model.model.layers[0].mlp.experts.gate_up_proj.grad
    assert isinstance(grad, DTensor) and grad.dtype == torch.float32 and grad.to_local().abs().sum() > 0
    assert abs(loss.item() - reference(**mine).loss.item()) < 2e-2 * abs(loss.item())


@pytest.mark.slow
def test_ep2_x_cp2_ep2_with_sharded_copies_ep4_hsdp_tp2_and_ep2_x_tp2_equal_one_process():
    run_world(_world4, 4)


def test_ep_x_tp_layouts_it_cannot_take_are_refused_with_the_numbers():
    """ep × tp needs ep to span dp_shard × cp (the experts outside FSDP2, on the dense mesh) and
    no HSDP: the sizes alone decide (the same on every rank), so no world is needed."""
    from qwen35_accel.model.detect import FAMILIES, qwen35_parts
    from qwen35_accel.parallel.expert_parallel.experts import check_expert_parallel
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

    parts = qwen35_parts(build_tiny_moe_causal_lm(seed=0, num_experts=8), families=FAMILIES)
    check_expert_parallel(parts, ep=4, data_ranks=4, dp_replicate=1, tp_size=2)  # world 8: 8 experts, 1 per rank
    with pytest.raises(NotImplementedError, match=r"ep=2 with tp 2: under tensor parallelism ep must span all 4 ranks of "
                       r"dp_shard x cp .* ep=2 would leave 2 copies of each expert .* Choose ep=4, or no tp"):
        check_expert_parallel(parts, ep=2, data_ranks=4, dp_replicate=1, tp_size=2)
    with pytest.raises(NotImplementedError, match=r"ep=2 with tp 2 under HSDP \(dp_replicate 2\) is not built"):
        check_expert_parallel(parts, ep=2, data_ranks=2, dp_replicate=2, tp_size=2)
    with pytest.raises(ValueError, match=r"ep=4 x tp 4 = 16 does not divide the model's 8 experts"):
        check_expert_parallel(parts, ep=4, data_ranks=4, dp_replicate=1, tp_size=4)


@pytest.mark.parametrize("family", ["moe", "dense"])
def test_qwen35_accel_ep_without_the_fsdp2_path_is_refused_not_ignored(monkeypatch, family):
    """QWEN35_ACCEL_EP=2 where the plugin's FSDP2 preparation does not run (one process here; DDP
    takes the same patch point): every expert would stay on every rank, so `prepare` raises."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from qwen35_accel import install
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_moe_causal_lm

    install()
    monkeypatch.setenv("QWEN35_ACCEL_EP", "2")
    AcceleratorState._reset_state(reset_partial_state=True)
    model = (build_tiny_moe_causal_lm if family == "moe" else build_tiny_causal_lm)(seed=0)
    try:
        with pytest.raises(NotImplementedError, match=r"QWEN35_ACCEL_EP=2 asks for expert parallelism, .* without FSDP"):
            Accelerator(cpu=True).prepare(model)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _ram_efficient_worker(rank: int, world: int) -> None:
    import os

    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, random_batch
    from test_accelerate_plugin import _accelerator
    from _parity import assert_params_match

    os.environ["QWEN35_ACCEL_EP"] = "2"
    try:
        accelerator = _accelerator(world, 1, cpu_ram_efficient_loading=True)
        reference = build_tiny_moe_causal_lm(seed=0)
        # Only rank 0 holds the real weights (as Transformers loads them under this setting).
        model = build_tiny_moe_causal_lm(seed=0 if rank == 0 else 123)
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # Accelerate 1.15: together
        assert model.model.layers[0].mlp.experts.num_experts == 3
        assert_params_match(model, reference, atol=0)  # every expert where it belongs, bitwise
        accelerator.backward(model(**random_batch(2, 16, reference.config.vocab_size, seed=3 + rank)).loss)
    finally:
        del os.environ["QWEN35_ACCEL_EP"]


def test_cpu_ram_efficient_loading_puts_rank0s_experts_on_their_ep_ranks():
    """Accelerate's `fsdp_cpu_ram_efficient_loading` (rank 0 loads, the others start on meta) with
    QWEN35_ACCEL_EP=2: each rank ends with its experts' slices of rank 0's weights."""
    run_world(_ram_efficient_worker, 2)


def _lora_worker(rank: int, world: int) -> None:
    """PEFT LoRA (all-linear: the mixers, the shared expert and its gate; the router and the 3-D
    experts are not linear layers) on the tiny MoE, under ep 2 and under cp 2, against the
    PEFT model in one process: the loss and every adapter's gradient."""
    from peft import LoraConfig, get_peft_model

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm
    from test_lora import backward_and_check_loss, lora_moe, mesh_of

    for ep, cp in ((2, 1), (1, 2)):
        reference, model = lora_moe(), lora_moe()
        targets = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
        assert {"in_proj_qkv", "q_proj", "gate_proj", "shared_expert_gate"} <= targets and "experts" not in targets, targets
        mesh = mesh_of(world, cp)
        PARALLELIZER.apply(model, mesh, ep=ep)
        backward_and_check_loss(model, reference, mesh, dp=world // cp, cp=cp)
        trainable = assert_grads_match(model, reference)
        assert trainable == sum(p.requires_grad for p in reference.parameters()) > 0
    # Adapters on the 3-D experts (PEFT's target_parameters): refused before any change.
    base = build_tiny_moe_causal_lm(seed=0)
    wrapped = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]))
    with pytest.raises(NotImplementedError, match=r"PEFT adapters on the routed experts \(ParamWrapper around 3 layers"):
        PARALLELIZER.apply(wrapped, mesh_of(world, 1))
    dist.barrier()


def test_lora_on_moe_under_ep2_and_cp2_equals_one_process():
    run_world(_lora_worker, 2)
