"""torch.compile on a model the parallelizer prepared (what Accelerate's `dynamo_config` and
`TrainingArguments(torch_compile=True)` do after preparation): it traces, and the loss and every
gradient equal the eager model's. Before, the first compiled forward under plain FSDP2 crashed on
every rank (`AssertionError: Expected CellVariable, got UserDefinedObjectVariable in load_cell`):
dynamo traced the GatedDeltaNet layer's kernel choice, which reads the closure cells of
Transformers' Hub-kernel wrappers (now a constant computed outside the trace).

`aot_eager` traces forward and backward as inductor does, without its code generation (minutes
on 2 cores); speed is the benchmarks' business (issue 47)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from _parity import assert_close
from torch.distributed.device_mesh import init_device_mesh

pytestmark = pytest.mark.multiprocess


def _worker(rank: int, world: int) -> None:
    from torch._dynamo.utils import counters

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    mesh = init_device_mesh("cpu", (1, world, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    eager = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh)
    compiled_model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    batch = random_batch(2, 16, eager.config.vocab_size, seed=rank)
    want = eager(**batch).loss
    want.backward()
    torch._dynamo.reset()
    counters.clear()
    got = compiled(**batch).loss
    got.backward()
    # fp32 rtol 1e-5: aot_eager runs the traced ATen ops (a decomposition may sum in another order).
    assert_close(got.detach(), want.detach(), "loss")
    grads = dict(eager.named_parameters())
    for name, p in compiled_model.named_parameters():
        assert_close(p.grad.full_tensor(), grads[name].grad.full_tensor(), f"grad of {name}")
    assert sum(counters["stats"].values()) > 0 and counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])


def test_a_compiled_fsdp2_model_traces_and_equals_eager():
    run_world(_worker, 2)
