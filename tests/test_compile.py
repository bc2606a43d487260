"""torch.compile on a model the parallelizer prepared (what Accelerate's `dynamo_config` and
`TrainingArguments(torch_compile=True)` do after preparation): it traces, and the loss and every
gradient equal the eager model's. Before, the first compiled forward under plain FSDP2 crashed on
every rank (`AssertionError: Expected CellVariable, got UserDefinedObjectVariable in load_cell`):
dynamo traced the GatedDeltaNet layer's kernel choice, which reads the closure cells of
Transformers' Hub-kernel wrappers (now a constant computed outside the trace).

Under the Accelerate integration (no tp) the plugin compiles per decoder layer instead
(`parallel.regional_compile`): the regions between FSDP2 unit boundaries, so a step breaks no
graph (the whole-model compile above breaks at every unit's hooks: 14 breaks in a step of the
tiny model).

`aot_eager` traces forward and backward as inductor does, without its code generation (minutes
on 2 cores); speed is the benchmarks' business (issue 47, `benchmarks/compile_step.py`)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from _parity import assert_close
from torch.distributed.device_mesh import init_device_mesh

pytestmark = pytest.mark.multiprocess


def _eager_then_compiled(eager, compiled, params, batch) -> dict:
    """One forward and backward of each (the compiled after a dynamo reset); asserts the loss and
    every gradient of `params` (the compiled model's) equal eager's, fp32 rtol 1e-5: aot_eager runs
    the traced ATen ops (a decomposition may sum in another order). Returns dynamo's counters of the
    compiled step."""
    from torch._dynamo.utils import counters

    want = eager(**batch).loss
    want.backward()
    torch._dynamo.reset()
    counters.clear()
    got = compiled(**batch).loss
    got.backward()
    assert_close(got.detach(), want.detach(), "loss")
    grads = dict(eager.named_parameters())
    for name, p in params:
        assert_close(p.grad.full_tensor(), grads[name].grad.full_tensor(), f"grad of {name}")
    return {"stats": dict(counters["stats"]), "graph_break": dict(counters["graph_break"])}


def _worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    mesh = init_device_mesh("cpu", (1, world, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    eager = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh)
    compiled_model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    batch = random_batch(2, 16, eager.config.vocab_size, seed=rank)
    counters = _eager_then_compiled(eager, compiled, compiled_model.named_parameters(), batch)
    assert counters["stats"].get("unique_graphs", 0) >= 1, counters  # traced (with a break at every unit's hooks)


def test_a_compiled_fsdp2_model_traces_and_equals_eager():
    run_world(_worker, 2)


def _regional_worker(rank: int, world: int, cp: int, checkpointing: bool) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.model.detect import qwen35_parts
    from qwen35_accel.parallel.prepared import prepared_state
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, packed_documents, random_batch

    mesh = init_device_mesh("cpu", (1, world // cp, cp, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    # The pipeline's last step compiles the regions (`compile`, as a custom loop asks for it).
    eager, model = (PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh, activation_checkpointing=checkpointing, compile=compile)
                    for compile in (None, {"backend": "aot_eager"}))
    assert prepared_state(eager).compiled == ""
    regions = prepared_state(model).compiled
    assert regions == ("norms, MLP, attention projections and output, GatedDeltaNet projections and gated output, "
                       "GatedDeltaNet chunk summaries and reads (torch functions)" if cp > 1
                       else "norms, MLP, attention, GatedDeltaNet projections and gated output, GatedDeltaNet conv and "
                       "gated delta rule (torch functions)"), regions
    mixed = _count_mix_steps(qwen35_parts(model))
    packed, _ = packed_documents([5, 20, 7, 32], eager.config.vocab_size, seed=rank)  # one packed row of 4 documents
    padded = random_batch(2, 32, eager.config.vocab_size, seed=rank)
    for batch in (padded, packed):  # the conv and rule compiled for unpacked rows only
        is_packed = batch is packed
        if cp > 1:
            batch = shard_batch(batch, mesh["cp"])
        for m in (eager, model):
            m.zero_grad()
        mixed.clear()
        counters = _eager_then_compiled(eager, model, model.named_parameters(), batch)
        assert sum(counters["graph_break"].values()) == 0, counters["graph_break"]
        assert counters["stats"]["unique_graphs"] >= 4, counters["stats"]  # norms, MLP, GatedDeltaNet steps
        # With `use_cache` at the config's True (as the Trainer leaves it) the rule ran compiled, filling the cache
        # (before, only a forward without a cache did: the region was dead in training). Checkpointing turns the
        # cache off (and runs each forward twice).
        layers = eager.config.layer_types.count("linear_attention")
        step = "cp_summarise" if cp > 1 else "mix" if checkpointing else "prefill"
        want = {} if is_packed else {step: layers * (2 if checkpointing else 1)}
        assert dict(mixed) == want, (dict(mixed), want)


def _moe_regional_worker(rank: int, world: int, cp: int, ep: int) -> None:
    """Qwen3.5-MoE recording its router logits under ep (and cp): the regions compile without a
    graph break, loss and every gradient equal eager's."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.model.detect import FAMILIES, qwen35_parts
    from qwen35_accel.parallel.regional_compile import compile_layer_regions
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, random_batch

    mesh = init_device_mesh("cpu", (1, world // cp, cp, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    eager, model = (PARALLELIZER.apply(build_tiny_moe_causal_lm(seed=0, output_router_logits=True), mesh, ep=ep)
                    for _ in range(2))
    regions = compile_layer_regions(qwen35_parts(model, families=FAMILIES), context_parallel=cp > 1, backend="aot_eager")
    assert "shared expert" in regions, regions
    batch = random_batch(2, 32, eager.config.vocab_size, seed=rank // cp)
    if cp > 1:
        batch = shard_batch(batch, mesh["cp"])
    counters = _eager_then_compiled(eager, model, model.named_parameters(), batch)
    assert sum(counters["graph_break"].values()) == 0, counters["graph_break"]


@pytest.mark.parametrize("cp,ep", [(1, 2), (2, 2)], ids=["ep2", "ep2xcp2"])
def test_moe_regions_under_expert_parallelism_compile_without_a_graph_break_and_equal_eager(cp, ep):
    run_world(_moe_regional_worker, 2, cp, ep)


def _count_mix_steps(parts) -> "collections.Counter[str]":
    """Count the calls of every GatedDeltaNet layer's compiled conv-and-rule steps (a spy around them)."""
    import collections

    from qwen35_accel.model.fp32_gate import COMPILED_STEPS_ATTR

    calls: collections.Counter[str] = collections.Counter()

    def spy(name, step):
        def counted(*args, **kwargs):
            calls[name] += 1
            return step(*args, **kwargs)
        return counted

    for layer in parts.decoder_layers:
        steps = getattr(layer, "linear_attn", None) and layer.linear_attn.__dict__[COMPILED_STEPS_ATTR]
        for name in ("mix", "prefill", "cp_summarise") if steps else ():
            if name in steps:
                steps[name] = spy(name, steps[name])
    return calls


@pytest.mark.parametrize("cp,checkpointing", [(1, False), (1, True), (2, True)], ids=["fsdp2", "fsdp2-ac", "cp2-ac"])
def test_per_layer_regions_compile_without_a_graph_break_and_equal_eager(cp, checkpointing):
    run_world(_regional_worker, 2, cp, checkpointing)


def _accelerate_worker(rank: int, world: int) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch._dynamo.utils import counters

    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), dynamo_backend="aot_eager")
    model = build_tiny_causal_lm(seed=0)
    # An evaluation before training prepares the model alone (the Trainer's evaluation loop under FSDP), then
    # training prepares it again with its optimizer; Accelerate compiles it (whole) before each FSDP2 preparation.
    evaluated = accelerator.prepare(model)
    assert type(evaluated).__name__ == "FSDPQwen3_5ForCausalLM", type(evaluated)  # not torch.compile's wrapper
    assert not any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in accelerator._models), accelerator._models
    optimizer = torch.optim.SGD(evaluated.parameters(), lr=0.1)
    trained, optimizer = accelerator.prepare(evaluated, optimizer)
    assert trained is evaluated  # prepared once: the second prepare undid Accelerate's whole-model compile
    assert trained.model.layers[0].mlp._compiled_call_impl is not None  # and kept the plugin's regions
    batch = random_batch(2, 16, trained.config.vocab_size, seed=rank)
    torch._dynamo.reset()
    counters.clear()
    accelerator.backward(trained(**batch).loss)
    optimizer.step()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_accelerates_dynamo_config_prepares_a_model_twice_into_the_same_compiled_units():
    run_world(_accelerate_worker, 2)


def _tp_worker(rank: int, world: int) -> None:
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch._dynamo.utils import counters

    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), dynamo_backend="aot_eager",
                              parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=world // 2))
    reference = build_tiny_causal_lm(seed=0)
    model = build_tiny_causal_lm(seed=0)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in accelerator._models), accelerator._models
    assert model.model.layers[0].mlp._compiled_call_impl is not None  # the plugin's regions, on the tp slices
    batch = random_batch(4, 16, reference.config.vocab_size, seed=0)
    replica = accelerator.torch_device_mesh["dp_shard"].get_local_rank()  # the tp ranks share their replica's rows
    torch._dynamo.reset()
    counters.clear()
    loss = model(**{k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}).loss
    accelerator.backward(loss)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])  # the whole model: 15
    want = reference(**batch).loss
    want.backward()
    params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(gather_tensor_parallel(model, name, p.grad), params[name].grad, f"grad of {name}")


@pytest.mark.slow  # world 4
def test_accelerates_dynamo_config_under_tensor_parallelism_compiles_the_layers_regions():
    run_world(_tp_worker, 4)
