"""Transformers' Hub kernels (`kernelize`, Transformers >= 5.25 with `kernels`) never run in place
of qwen35_accel's layers: kernelize binds an instance-level `forward` on every marked module, which
would outlive our class swaps (the GatedDeltaNet would run Transformers' forward under CP: wrong)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

MARKED = (hf.Qwen3_5GatedDeltaNet, hf.Qwen3_5RMSNormGated, hf.Qwen3_5RMSNorm)


def _kernelized(path, monkeypatch) -> nn.Module:
    """A tiny Qwen3.5 as Transformers 5.25 leaves it after `from_pretrained` and `train()`, with each
    marked module's forward bound on the instance as kernelize binds it where it binds one (a Hub
    kernel's on a device its mapping serves; `kernels` 0.17's own class forward on any device).
    With a usable `kernels`, Transformers' own kernelize runs first (`kernels` 0.19 binds nothing on
    CPU: its function modules are per instance instead); the classes are marked
    (`kernel_layer_name`, Transformers' decorator) where `kernels` is absent, and every marked module
    without an instance forward gets its class forward bound (kernels' `_replace_forward`),
    `_use_kernels` set. `path`: a saved tiny model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).train()
    for cls in MARKED:
        if not hasattr(cls, "kernel_layer_name"):
            monkeypatch.setattr(cls, "kernel_layer_name", cls.__name__, raising=False)
    for module in model.modules():
        if isinstance(module, MARKED) and "forward" not in module.__dict__:
            module.forward = types.MethodType(type(module).forward, module)
    model._use_kernels = True
    assert all("forward" in m.__dict__ for m in model.modules() if isinstance(m, MARKED))
    return model


def test_the_fp32_gate_layers_run_their_own_forward_after_kernelize(tmp_path, monkeypatch):
    from qwen35_accel.model.fp32_gate import Fp32GateGatedDeltaNet, install_fp32_gate
    from qwen35_accel.model.state import state_of

    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    build_tiny_causal_lm(seed=0).save_pretrained(tmp_path)
    model = _kernelized(tmp_path, monkeypatch)
    install_fp32_gate(model)
    layers = [m for m in model.modules() if isinstance(m, Fp32GateGatedDeltaNet)]
    assert layers and all(m.forward.__func__ is Fp32GateGatedDeltaNet.forward for m in layers)
    assert not [m for m in model.modules() if isinstance(m, MARKED) and "forward" in m.__dict__]
    assert state_of(model).hub_kernels == []  # turned off; nothing but own forwards had been bound (CPU)
    assert model._use_kernels is False or not hasattr(type(model), "use_kernels")  # train() kernelizes no more


def test_swap_class_drops_a_forward_bound_on_the_instance():
    from qwen35_accel.model.hub_kernels import swap_class

    class Doubled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    layer = nn.Linear(3, 3)
    layer.forward = types.MethodType(nn.Linear.forward, layer)  # what kernelize leaves
    hook = layer.register_forward_hook(lambda *a: None)  # other instance state stays
    swap_class(layer, Doubled)
    x = torch.randn(2, 3)
    assert torch.equal(layer(x), 2 * nn.functional.linear(x, layer.weight, layer.bias))
    assert hook.id in layer._forward_hooks


@pytest.mark.multiprocess
def test_context_parallel_after_kernelize_equals_one_process(tmp_path, monkeypatch):
    """cp 2 on a kernelized model: loss and every gradient equal the unmodified model's (Transformers'
    forward on each rank's chunks, without the state passed between ranks, does not)."""
    from _dist import run_world

    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    build_tiny_causal_lm(seed=0).save_pretrained(tmp_path)
    run_world(_kernelized_cp_worker, 2, str(tmp_path))


def _kernelized_cp_worker(rank: int, world: int, path: str) -> None:
    import pathlib

    from test_hub_kernels import _kernelized

    from _parity import assert_close, assert_grads_match
    from test_cp_model import cp_mesh

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    monkeypatch = pytest.MonkeyPatch()
    try:
        model = _kernelized(pathlib.Path(path), monkeypatch)
        reference = build_tiny_causal_lm(seed=0)
        mesh = cp_mesh(world, 2)
        PARALLELIZER.apply(model, mesh)
        batch = random_batch(2, 32, reference.config.vocab_size, seed=7)
        ref = reference(**batch)
        ref.loss.backward()
        out = model(**shard_batch(batch, mesh["cp"]))
        out.loss.backward()
        assert_close(out.loss.detach(), ref.loss.detach(), "loss")
        assert assert_grads_match(model, reference) == sum(1 for _ in reference.parameters())
    finally:
        monkeypatch.undo()
