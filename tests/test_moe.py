"""Qwen3.5-MoE under the parallelizer (issue 46): the premise that its GatedDeltaNet is the
dense one's code, the fp32 gate holder and the tiled loss equal to the unmodified model, FSDP2
at world 2 (the tiled loss by default), cp 2, the VLM class, the global router balance and HSDP
equal to one process (loss, every gradient, and the experts every token was routed to).
Expert and tensor parallelism: tests/test_moe_ep.py."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf_qwen4

from _dist import run_world
from _parity import assert_close, assert_grads_match, documents_alone

BATCH_PER_RANK, SEQ, STEPS = 2, 24, 2


@pytest.mark.parametrize("name", ["GatedDeltaNet", "RMSNormGated", "RMSNorm", "TextRotaryEmbedding"])
def test_the_moe_familys_layers_are_the_dense_ones_code(name):
    """`Fp32GateMoeGatedDeltaNet` runs the dense layer's code on MoE layers: sound only while
    Transformers' MoE classes are the dense ones' source with the names mapped."""
    dense = inspect.getsource(getattr(hf, f"Qwen3_5{name}"))
    moe = inspect.getsource(getattr(hf_moe, f"Qwen3_5Moe{name}")).replace("Qwen3_5Moe", "Qwen3_5")
    assert moe == dense, f"Qwen3_5Moe{name} is no longer Qwen3_5{name}'s code: review Fp32GateMoeGatedDeltaNet"
    for function in ("apply_mask_to_padding_states", "l2norm"):
        assert inspect.getsource(getattr(hf_moe, function)) == inspect.getsource(getattr(hf, function)), function


def test_the_fp32_gate_holder_on_moe_layers_equals_the_unmodified_model():
    from qwen35_accel.model.detect import qwen35_family, qwen35_parts
    from qwen35_accel.model.fp32_gate import has_fp32_gate, install_fp32_gate
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, random_batch

    reference = build_tiny_moe_causal_lm(seed=0, output_router_logits=True)
    model = copy.deepcopy(reference)
    assert qwen35_family(model) == "moe" and qwen35_parts(model, families=("dense", "moe")).family == "moe"
    with pytest.raises(TypeError, match="the MoE family has no vocab-parallel lm_head"):
        qwen35_parts(model)  # the dense-only callers (the vocab-parallel lm_head) refuse it
    assert install_fp32_gate(model) == 2
    assert all(has_fp32_gate(layer.linear_attn) for layer in model.model.layers if hasattr(layer, "linear_attn"))
    assert sorted(model.state_dict()) == sorted(reference.state_dict())
    batch = random_batch(2, SEQ, reference.config.vocab_size, seed=1)
    want, got = reference(**batch), model(**batch)
    want.loss.backward()
    got.loss.backward()
    assert torch.equal(got.loss, want.loss) and torch.equal(got.aux_loss, want.aux_loss)
    assert assert_grads_match(model, reference, rtol=0, atol=0) > 0


@pytest.mark.parametrize("router_loss", [False, True])
def test_the_tiled_loss_on_moe_equals_transformers_loss_with_the_routers_loss(router_loss):
    """`install_tiled_loss` on `Qwen3_5MoeForCausalLM`: no logits, the same loss (the router's
    load-balancing loss added as Transformers adds it) and gradients (fp32 rtol 1e-5: blocks
    sum the cross entropy in another order)."""
    from qwen35_accel.parallel.tiled_loss import install_tiled_loss
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, random_batch

    reference = build_tiny_moe_causal_lm(seed=0, output_router_logits=router_loss)
    model = copy.deepcopy(reference)
    assert install_tiled_loss(model, tile=8)
    batch = random_batch(2, SEQ, reference.config.vocab_size, seed=1)
    want, got = reference(**batch), model(**batch)
    assert got.logits is None and (got.aux_loss is None) is (not router_loss)
    assert_close(got.loss, want.loss, "loss")
    if router_loss:
        assert torch.equal(got.aux_loss, want.aux_loss) and len(got.router_logits) == 3
    want.loss.backward()
    got.loss.backward()
    assert assert_grads_match(model, reference) > 0


# Documents of every length the conv window and the chunked rule distinguish (as test_packing).
PACKED = [70, 24, 3, 1, 40]


def test_every_document_of_a_packed_moe_row_equals_the_document_alone():
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, packed_documents

    reference = build_tiny_moe_causal_lm(seed=0)
    model = copy.deepcopy(reference)
    install_fp32_gate(model)
    batch, documents = packed_documents(PACKED, reference.config.vocab_size, seed=1)
    got = model(**batch)
    want_logits, want_loss = documents_alone(reference, documents)
    assert_close(got.logits, want_logits, "logits")
    assert_close(got.loss, want_loss, "loss")
    got.loss.backward()
    want_loss.backward()
    assert assert_grads_match(model, reference) > 0


def _routing(model: torch.nn.Module) -> tuple[list[torch.Tensor], list]:
    """Every MoE layer's chosen experts `[tokens, top_k]`, appended per forward."""
    chosen: list[torch.Tensor] = []
    hooks = [module.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].detach().clone()))
             for module in model.modules() if isinstance(module, (hf_moe.Qwen3_5MoeTopKRouter, hf_next.Qwen3NextTopKRouter, hf_qwen4.Qwen4ExpTextTopKRouter))]
    return chosen, hooks


def _dp_worker(rank: int, world: int) -> None:
    from qwen35_accel.model.fp32_gate import HOLDER_NAME
    from test_moe_ep import _parity

    # FSDP2 at world 2, every expert on every rank: each rank's rows against one process on
    # them (the router's loss each rank's: stock's meaning under dp), through SGD steps; with
    # checkpointing and activation offload (each layer's input in host memory, recomputed: the
    # same routing).
    model, _ = _parity(rank, world, ep=1, cp=1, num_experts=6, activation_checkpointing=True, activation_offload=True)
    from qwen35_accel.model.state import find_state

    offload = find_state(model).activation_offload
    assert offload.stats.tensors > 0, offload.stats  # every layer's input went through the offload hooks
    holders = [m for name, m in model.named_modules() if name.endswith(HOLDER_NAME)]
    assert len(holders) == 2 and all(p.dtype == torch.float32 for h in holders for p in h.parameters())
    dist.barrier()


@pytest.mark.multiprocess
def test_fsdp2_on_moe_equals_one_process_with_the_same_routing():
    run_world(_dp_worker, 2)


def test_the_plugin_takes_moe_models_under_every_layout():
    """Dense or MoE, any parallelism config (before tp: MoE was left to Accelerate's own path)."""
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig

    from qwen35_accel.integrations.targets import is_plugin_fsdp2_module
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_moe_causal_lm

    model, dense = build_tiny_moe_causal_lm(seed=0), build_tiny_causal_lm(seed=0)
    for sizes in ({}, {"dp_shard_size": 2}, {"cp_size": 2}, {"tp_size": 2}):
        accelerator = SimpleNamespace(parallelism_config=ParallelismConfig(**sizes) if sizes else None)
        assert is_plugin_fsdp2_module(model, accelerator) and is_plugin_fsdp2_module(dense, accelerator), sizes
    assert not is_plugin_fsdp2_module(torch.nn.Linear(2, 2), None)


def test_a_bf16_load_of_a_moe_checkpoint_gets_its_fp32_gates_back_bitwise(tmp_path):
    """`from_pretrained(..., dtype=torch.bfloat16)` rounds the gates; the holders read the
    checkpoint's fp32 values back, as for the dense family."""
    from transformers import AutoModelForCausalLM

    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.model.state import state_of
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

    saved = build_tiny_moe_causal_lm(seed=0)
    saved.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.model.layers[0].linear_attn.A_log.dtype == torch.bfloat16
    assert install_fp32_gate(loaded) == 2 and state_of(loaded).restored_gates == 4
    for got, want in zip(loaded.model.layers[:2], saved.model.layers[:2]):
        for name in ("A_log", "dt_bias"):
            value = getattr(got.linear_attn, name)
            assert value.dtype == torch.float32 and torch.equal(value, getattr(want.linear_attn, name)), name


def _cp_worker(rank: int, world: int) -> None:
    """cp 2 against one process on whole rows: the loss with the router's load-balancing loss
    (its sums reduced over the cp group), every gradient, each token's experts; the last row
    right-padded (the padding mask enters the router's loss)."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.context_parallel.attention import ContextParallelMoeAttention
    from qwen35_accel.parallel.context_parallel.gated_delta_net import ContextParallelMoeGatedDeltaNet
    from qwen35_accel.parallel.context_parallel.chunks import unshard_sequence
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm
    from test_cp_model import _padded_batch, cp_mesh

    reference = build_tiny_moe_causal_lm(seed=0, output_router_logits=True)
    model = build_tiny_moe_causal_lm(seed=0, output_router_logits=True)
    mesh = cp_mesh(world, world)
    PARALLELIZER.apply(model, mesh)
    assert type(model.model.layers[0].linear_attn) is ContextParallelMoeGatedDeltaNet
    assert type(model.model.layers[2].self_attn) is ContextParallelMoeAttention
    ref_routes, _ = _routing(reference)
    routes, _ = _routing(model)
    batch = _padded_batch(2, 32, reference.config.vocab_size, seed=7)
    want = reference(**batch)
    want.loss.backward()
    got = model(**shard_batch(batch, mesh["cp"]))
    got.loss.backward()
    assert_close(got.aux_loss.detach(), want.aux_loss.detach(), "router loss")
    assert_close(got.loss.detach(), want.loss.detach(), "loss")
    assert assert_grads_match(model, reference) > 0
    for layer, (mine, whole) in enumerate(zip(routes, ref_routes)):  # [2 · local seq, k] against [2 · 32, k]
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine.contiguous(), group=mesh["cp"].get_group())
        local = [g.reshape(2, -1, mine.shape[-1]) for g in gathered]
        ordered = unshard_sequence(local, world, seq_dim=1)
        assert torch.equal(ordered.reshape(whole.shape), whole), f"layer {layer}: tokens routed to other experts under cp"
    # Packed rows under cp 2 (the router's loss off: one process computes it over the whole row,
    # its documents alone cannot): every document as if alone.
    from qwen35_accel.testing.tiny import packed_documents

    model.zero_grad(), reference.zero_grad()
    packed, documents = packed_documents(PACKED, reference.config.vocab_size, seed=3)
    _, want_loss = documents_alone(reference, documents)
    want_loss.backward()
    got = model(**shard_batch(packed, mesh["cp"]), output_router_logits=False)
    got.loss.backward()
    assert_close(got.loss.detach(), want_loss.detach(), "packed rows: loss")
    assert assert_grads_match(model, reference) > 0
    # Outside the tiled training loss the router's loss would be this rank's chunks': refused.
    with torch.no_grad(), pytest.raises(NotImplementedError, match="exact only in the tiled training loss"):
        model(**shard_batch(batch, mesh["cp"]))
    dist.barrier()


@pytest.mark.multiprocess
def test_cp2_on_moe_equals_one_process_router_loss_and_routing_included():
    run_world(_cp_worker, 2)


def test_accelerate_in_one_process_holds_a_bf16_loaded_moes_gates_in_fp32(tmp_path, capfd):
    """Without FSDP (one process; DDP takes the same patch point) Accelerate's `prepare` gives a
    bf16-loaded MoE model the fp32 holders with the checkpoint's values, trained in fp32."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    from qwen35_accel import install
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, random_batch

    install()
    AcceleratorState._reset_state(reset_partial_state=True)
    saved = build_tiny_moe_causal_lm(seed=1)
    saved.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
        assert "Qwen3_5MoeForCausalLM prepared by qwen35_accel without FSDP (one process)" in capfd.readouterr().err
        gates = {name: p for name, p in model.named_parameters() if name.endswith((".A_log", ".dt_bias"))}
        want = {name: p for name, p in saved.named_parameters() if name in gates}
        assert len(gates) == len(want) == 4
        for name, value in gates.items():
            assert value.dtype == torch.float32 and torch.equal(value.detach(), want[name].detach()), name
        accelerator.backward(model(**random_batch(2, 16, model.config.vocab_size, seed=0)).loss)
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in gates.values())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)



@pytest.mark.parametrize("router_loss", [False, True])
def test_the_moe_vlms_tiled_loss_with_images_equals_transformers(router_loss):
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.parallel.tiled_loss import install_tiled_loss
    from qwen35_accel.testing.tiny import build_tiny_moe_vlm, random_vlm_batch

    reference = build_tiny_moe_vlm(seed=0, output_router_logits=router_loss)
    model = copy.deepcopy(reference)
    assert install_fp32_gate(model) == 2 and install_tiled_loss(model, tile=8)
    batch = random_vlm_batch(reference.config, 2, 40, seed=0)
    want, got = reference(**batch), model(**batch)
    assert got.logits is None and got.image_outputs is not None
    assert_close(got.loss, want.loss, "loss")
    if router_loss:
        assert torch.equal(got.aux_loss, want.aux_loss)
    want.loss.backward()
    got.loss.backward()
    assert assert_grads_match(model, reference) > 0


def _vlm_worker(rank: int, world: int) -> None:
    """The MoE VLM with images and a trainable tower: dp 2 (each rank its rows), then cp 2 (every
    rank its chunks of the same rows, the tower's work split), against one process: loss with
    the router's loss, every gradient."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import build_tiny_moe_vlm, placed_vlm_batch
    from test_fsdp_parity import accelerate_style_mesh
    from test_vlm_cp import FULL, ONE, SEQ, _mesh

    config = build_tiny_moe_vlm(seed=0).config
    rows = [placed_vlm_batch(config, layout, SEQ, seed=300 + r, padding=padding) for r, (layout, padding) in enumerate((FULL, ONE))]
    for layout in ("dp", "cp"):
        reference = build_tiny_moe_vlm(seed=0, output_router_logits=True)
        model = build_tiny_moe_vlm(seed=0, output_router_logits=True)
        if layout == "dp":
            mesh = accelerate_style_mesh(world)
            PARALLELIZER.apply(model, mesh)
            parts = [reference(**batch).loss for batch in rows]  # the router's loss: each rank's rows
            (sum(parts) / world).backward()
            got = model(**rows[rank])
            want = parts[rank]
        else:
            mesh = _mesh(world)
            PARALLELIZER.apply(model, mesh)
            want = reference(**rows[0])
            want.loss.backward()
            want = want.loss
            got = model(**shard_batch(rows[0], mesh["cp"]))
        got.loss.backward()
        assert_close(got.loss.detach(), want.detach(), f"{layout}: loss")
        assert assert_grads_match(model, reference) > 0
    dist.barrier()


@pytest.mark.multiprocess
def test_the_moe_vlm_with_images_under_dp2_and_cp2_equals_one_process():
    run_world(_vlm_worker, 2)



def _global_balance_worker(rank: int, world: int) -> None:
    """moe_balance="global" under dp 2: the router's loss counts the global batch, so every
    gradient and the ranks' mean loss equal one process on the whole batch (the cross entropy's
    rank means average to the global mean: equal token counts); "rank" would not (its router
    loss is each rank's rows', the comparison `_dp_worker` makes)."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.model.state import state_of
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_moe_causal_lm, random_batch
    from test_fsdp_parity import accelerate_style_mesh

    reference = build_tiny_moe_causal_lm(seed=0, output_router_logits=True, router_aux_loss_coef=0.5)
    model = build_tiny_moe_causal_lm(seed=0, output_router_logits=True, router_aux_loss_coef=0.5)
    PARALLELIZER.apply(model, accelerate_style_mesh(world), moe_balance="global")
    batch = random_batch(BATCH_PER_RANK * world, SEQ, reference.config.vocab_size, seed=5)
    want = reference(**batch)
    want.loss.backward()
    got = model(**{k: v[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for k, v in batch.items()})
    got.loss.backward()
    assert_close(got.aux_loss.detach(), want.aux_loss.detach(), "router loss over the global batch")
    mean = got.loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    assert_close(mean, want.loss.detach(), "mean loss")
    assert assert_grads_match(model, reference) > 0
    # Dense models have no router: the option changes nothing there.
    dense = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), accelerate_style_mesh(world), moe_balance="global")
    assert state_of(dense).balance_group is None
    with pytest.raises(ValueError, match="moe_balance"):
        PARALLELIZER.apply(build_tiny_moe_causal_lm(seed=0), accelerate_style_mesh(world), moe_balance="batch")
    dist.barrier()


@pytest.mark.multiprocess
def test_a_global_router_balance_under_dp2_equals_one_process_on_the_whole_batch():
    run_world(_global_balance_worker, 2)


def _hsdp_worker(rank: int, world: int) -> None:
    """HSDP 2 × 2 on the MoE model equals one process (each rank its rows; the router's loss off:
    per rank it is each rank's rows', tested at dp 2); moe_balance="global" refused with HSDP."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, random_batch
    from test_fsdp_parity import accelerate_style_mesh

    reference = build_tiny_moe_causal_lm(seed=0)
    model = build_tiny_moe_causal_lm(seed=0)
    PARALLELIZER.apply(model, accelerate_style_mesh(world, dp_replicate=2))
    batch = random_batch(BATCH_PER_RANK * world, SEQ, reference.config.vocab_size, seed=9)
    reference(**batch).loss.backward()
    loss = model(**{k: v[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for k, v in batch.items()}).loss
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    assert_close(mean, reference(**batch).loss.detach(), "mean loss")
    assert assert_grads_match(model, reference) > 0
    with pytest.raises(NotImplementedError, match=r"moe_balance='global' with HSDP \(dp_replicate 2\) is not built"):
        PARALLELIZER.apply(build_tiny_moe_causal_lm(seed=0), accelerate_style_mesh(world, dp_replicate=2), moe_balance="global")
    dist.barrier()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hsdp_2x2_on_moe_equals_one_process():
    run_world(_hsdp_worker, 4)


def test_regional_compile_on_moe_compiles_the_shared_expert_and_equals_eager():
    """torch.compile per decoder layer (aot_eager): the regions of the dense family, of the sparse
    block its shared expert only (the experts and the router route by data); loss and every
    gradient equal eager's."""
    from qwen35_accel.model.detect import FAMILIES, qwen35_parts
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.parallel.regional_compile import compile_layer_regions
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, random_batch

    from torch._dynamo.utils import counters

    reference = build_tiny_moe_causal_lm(seed=0, output_router_logits=True)
    model = copy.deepcopy(reference)
    install_fp32_gate(model)
    regions = compile_layer_regions(qwen35_parts(model, families=FAMILIES), context_parallel=False, backend="aot_eager")
    assert "MLP" not in regions and regions.startswith("norms, shared expert, attention, GatedDeltaNet projections")
    assert model.model.layers[0].mlp.shared_expert._compiled_call_impl is not None
    assert model.model.layers[0].mlp.experts._compiled_call_impl is None
    batch = random_batch(2, SEQ, reference.config.vocab_size, seed=0)
    counters.clear()
    want, got = reference(**batch).loss, model(**batch).loss
    want.backward()
    got.backward()
    # Transformers records the router logits by hooks, also on attention modules (a ContextVar read):
    # inside a compiled call they broke the graph once per step.
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert_close(got.detach(), want.detach(), "loss")
    assert assert_grads_match(model, reference) > 0


def test_parallel_options_are_one_object_built_by_the_keywords_or_the_settings():
    """`PARALLELIZER.apply` takes a `ParallelOptions` (or keywords building one): a name it lacks is a
    TypeError before anything changes; the configuration's `parallel` carries every knob that chooses the layout."""
    import dataclasses

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.settings import PluginSettings
    from qwen35_accel.parallel.options import ParallelOptions
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

    model = build_tiny_moe_causal_lm(seed=0)
    with pytest.raises(TypeError, match="exp"):
        PARALLELIZER.apply(model, None, exp=2)  # a misspelt ep
    assert not any(name.endswith("_fp32_params") for name, _ in model.named_modules())  # untouched
    with pytest.raises(ValueError, match=r"moe_balance='batch'; expected one of \('rank', 'global'\)"):
        ParallelOptions(moe_balance="batch").checked()
    assert ParallelOptions(tiled_loss=True).checked().tiled_loss == "recompute"
    settings = PluginSettings.from_env({"QWEN35_ACCEL_EP": "4", "QWEN35_ACCEL_TILED_LOSS": "hold",
                                        "QWEN35_ACCEL_CP_STATE_EXCHANGE": "scan", "QWEN35_ACCEL_MOE_BALANCE": "global"})
    options = settings.with_parallel(activation_checkpointing=True).parallel
    assert (options.ep, options.tiled_loss, options.cp_state_exchange, options.moe_balance, options.activation_checkpointing) == (
        4, "hold", "scan", "global", True)
    # Every field of the options is documented where they are declared, and `apply` points there.
    doc = ParallelOptions.__doc__
    assert all(f"`{field.name}`" in doc for field in dataclasses.fields(ParallelOptions))
    assert "`ParallelOptions`" in PARALLELIZER.apply.__doc__
