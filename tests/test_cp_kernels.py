"""The CP GatedDeltaNet's chunk kernel interface, and torch.compile per decoder layer under CP.

The FLA branch of `select_kernel` needs CUDA and `fla` (not verifiable here); these tests
run the interface with the torch kernel, and compiled layers against the unmodified model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_world
from _parity import assert_close, assert_grads_match
from torch.distributed.device_mesh import init_device_mesh

from qwen35_accel.ops.gated_delta import fla_kernel, select_kernel, torch_kernel


def test_cpu_tensors_get_the_torch_kernel_never_fla():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    assert select_kernel(torch.device("cpu")) is torch_kernel()
    # Transformers' decorated name resolves to FLA whenever fla imports; ours is the torch
    # function underneath, on any device.
    assert torch_kernel() is not hf.torch_chunk_gated_delta_rule and torch_kernel().__module__ == hf.__name__
    if fla_kernel() is None:
        assert select_kernel(torch.device("cuda")) is torch_kernel()


def _cp_mesh(world: int):
    mesh = init_device_mesh("cpu", (1, 1, world, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def _kernel_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.context_parallel import gated_delta_net as cp_gdn
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    chosen = []

    def counting_select(device: torch.device):
        chosen.append(device.type)
        return select_kernel(device)

    cp_gdn.select_kernel = counting_select  # see how often layers choose
    calls = []

    def counting_kernel(*args, **kwargs):
        calls.append(args[2].shape[-1])  # the value width: v_dim + k_dim ([v | 0])
        return torch_kernel()(*args, **kwargs)

    mesh = _cp_mesh(world)
    model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh)
    reference = build_tiny_causal_lm(seed=0)
    layers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    batch = random_batch(2, 32, reference.config.vocab_size, seed=1)
    local = shard_batch(batch, mesh["cp"])
    for _ in range(2):
        model(**local)
    assert chosen == ["cpu"] * len(layers), chosen  # once per layer, not per forward
    assert all(layer.cp_kernel is torch_kernel() for layer in layers)

    # The interface: a kernel given to the layer computes every chunk and summary.
    for layer in layers:
        layer.cp_kernel = counting_kernel
    out = model(**local)
    config = reference.config
    assert calls == [config.linear_value_head_dim + config.linear_key_head_dim] * 2 * len(layers), calls
    ref = reference(**batch)
    ref.loss.backward()
    out.loss.backward()
    assert_close(out.loss.detach(), ref.loss.detach(), "loss through the kernel interface")
    assert assert_grads_match(model, reference) == sum(1 for _ in reference.parameters())


@pytest.mark.multiprocess
def test_cp_layers_choose_their_kernel_once_and_run_every_chunk_through_it():
    run_world(_kernel_worker, 2)


def _compile_worker(rank: int, world: int, exchange: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.context_parallel.gated_delta_net import ContextParallelGatedDeltaNet
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    torch._dynamo.config.cache_size_limit = 64
    reference = build_tiny_causal_lm(seed=0)
    model = build_tiny_causal_lm(seed=0)
    # fp32 compute, so the comparison is at fp32 tolerance; the units are still dtype-uniform
    # (the fp32 gate holder its own unit).
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mesh = _cp_mesh(world)
    PARALLELIZER.apply(model, mesh, mp_policy=policy)
    for layer in model.model.layers:
        if isinstance(getattr(layer, "linear_attn", None), ContextParallelGatedDeltaNet):
            layer.linear_attn.state_exchange = exchange
        layer.compile(backend="aot_eager")  # what Accelerate's --torch_compile does per decoder layer
    batch = random_batch(2, 32, reference.config.vocab_size, seed=2)
    ref = reference(**batch)
    ref.loss.backward()
    out = model(**shard_batch(batch, mesh["cp"]))
    out.loss.backward()
    assert_close(out.loss.detach(), ref.loss.detach(), f"compiled loss, {exchange}")
    assert assert_grads_match(model, reference) == sum(1 for _ in reference.parameters())


@pytest.mark.multiprocess
@pytest.mark.parametrize("exchange", ["allgather", "scan"])
def test_compiled_decoder_layers_under_cp_equal_one_process(exchange):
    run_world(_compile_worker, 2, exchange)
