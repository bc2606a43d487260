"""The CP GatedDeltaNet's kernel interfaces (chunk rule, causal conv), and torch.compile per
decoder layer under CP.

The FLA and causal-conv1d branches need CUDA and those packages (not verifiable here); these
tests run the interfaces with the torch kernels, and compiled layers against the unmodified
model.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from _parity import assert_close, assert_grads_match
from torch.distributed.device_mesh import init_device_mesh

from qwen35_accel.ops.causal_conv import causal_conv1d_kernel, select_conv_kernel, torch_conv_kernel
from qwen35_accel.ops.gated_delta import fla_kernel, select_kernel, torch_kernel


def test_cpu_tensors_get_the_torch_kernel_never_fla():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    assert select_kernel(torch.device("cpu")) is torch_kernel()
    # Transformers' decorated name resolves to FLA whenever fla imports; ours is the torch
    # function underneath, on any device.
    assert torch_kernel() is not hf.torch_chunk_gated_delta_rule and torch_kernel().__module__ == hf.__name__
    if fla_kernel() is None:
        assert select_kernel(torch.device("cuda")) is torch_kernel()


def test_cpu_tensors_get_the_torch_conv_kernel():
    assert select_conv_kernel(torch.device("cpu")) is torch_conv_kernel
    if causal_conv1d_kernel() is None:
        assert select_conv_kernel(torch.device("cuda")) is torch_conv_kernel


def _transformers_conv():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from qwen35_accel.ops.kernels import unwrap_function

    return unwrap_function(hf.causal_conv1d_fn)  # its torch fallback, whatever is installed


@pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, None)])
def test_torch_conv_kernel_is_transformers_fallback(bias, activation):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 13, generator=gen)
    weight, b = torch.randn(8, 4, generator=gen), torch.randn(8, generator=gen) if bias else None
    want = _transformers_conv()(x, weight, b, activation=activation)
    assert torch.equal(torch_conv_kernel(x, weight, b, activation=activation), want)


def test_seq_idx_keeps_documents_apart_as_each_document_alone():
    """causal-conv1d's seq_idx rule in the torch kernel: each document convolved alone
    (Transformers' fallback), output and gradients, channel-last input as GatedDeltaNet has."""
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 1, 2, 9, 3]  # shorter than the window, a single token, longer
    hidden = torch.randn(1, sum(lengths), 8, generator=gen)
    weight = torch.randn(8, 4, generator=gen, requires_grad=True)
    bias = torch.randn(8, generator=gen, requires_grad=True)
    x = hidden.clone().requires_grad_(True)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None]
    out = torch_conv_kernel(x.transpose(1, 2), weight, bias, seq_idx=seq_idx, activation="silu")
    ref_x = hidden.clone().requires_grad_(True)
    ref_w, ref_b = weight.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    alone = [_transformers_conv()(d.transpose(1, 2), ref_w, ref_b, activation="silu") for d in ref_x.split(lengths, dim=1)]
    want = torch.cat(alone, dim=-1)
    # fp32 rtol 1e-5: the masked taps are summed one by one, F.conv1d sums them in its own order.
    assert_close(out, want, "conv output")
    upstream = torch.randn(want.shape, generator=gen)
    (out * upstream).sum().backward()
    (want * upstream).sum().backward()
    for mine, ref, name in ((x, ref_x, "input"), (weight, ref_w, "weight"), (bias, ref_b, "bias")):
        assert_close(mine.grad, ref.grad, f"conv {name} gradient")


def _cp_mesh(world: int):
    mesh = init_device_mesh("cpu", (1, 1, world, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def _kernel_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.context_parallel import gated_delta_net as cp_gdn
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, packed_documents, random_batch

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
    assert all(layer.cp_conv_kernel is torch_conv_kernel for layer in layers)

    # The conv interface gets what causal-conv1d requires: channel-last input (stride 1
    # along channels) and, for packed rows, a contiguous int32 seq_idx of the input's length.
    seen = []

    def checking_conv(x, weight, bias=None, seq_idx=None, activation=None):
        seen.append(seq_idx is not None)
        assert x.stride(1) == 1 and x.stride(2) > 1, x.stride()
        if seq_idx is not None:
            assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (x.shape[0], x.shape[2])
        return torch_conv_kernel(x, weight, bias, seq_idx=seq_idx, activation=activation)

    for layer in layers:
        layer.cp_conv_kernel = checking_conv
    packed, _ = packed_documents([9, 2, 17, 4], config.vocab_size, seed=3)
    for whole in (batch, packed):
        model(**shard_batch(whole, mesh["cp"]))
    assert seen == [False] * 2 * len(layers) + [True] * 2 * len(layers), seen  # two chunks per rank


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
@pytest.mark.slow  # torch.compile of the decoder layers: minutes on 2 cores
@pytest.mark.parametrize("exchange", ["allgather", "scan"])
def test_compiled_decoder_layers_under_cp_equal_one_process(exchange):
    run_world(_compile_worker, 2, exchange)
