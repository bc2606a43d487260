"""Kernel detection (`qwen35_accel.ops.kernels`): an optional package counts only if it
imports, is recent enough and has what we call; the GatedDeltaNet layers, the CP kernel
interfaces and `env` all read that one decision.

Fake packages put on `sys.path` stand in for FLA / causal-conv1d builds (no GPU here): one
that raises on import (an ABI mismatch), one too old by its dist-info. The decision for
CUDA tensors is read where it is made (`select_kernel(torch.device("cuda"))`, `varlen_ok`),
without running a kernel.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from qwen35_accel.model import kernel_functions
from qwen35_accel.ops import kernels
from qwen35_accel.ops.causal_conv import select_conv_kernel, torch_conv_kernel
from qwen35_accel.ops.gated_delta import fla_kernel, select_kernel, torch_kernel

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda")  # a device object only: nothing here allocates on it
CUDA_TENSOR = types.SimpleNamespace(is_cuda=True, device=CUDA)  # what `_varlen_kernel` / `_kernel` read of a tensor


def _fake_fla(root: Path, version: str | None, body: str, conv_args: str | None = None) -> None:
    """`fla` under `root` whose `__init__` runs `body`, with `fla.ops.gated_delta_rule.chunk_gated_delta_rule`
    (and with `conv_args`, `fla.modules.convolution.causal_conv1d(x, weight, bias, <conv_args>)`);
    with `version`, a `flash_linear_attention-<version>.dist-info` beside it."""
    ops = root / "fla" / "ops" / "gated_delta_rule"
    ops.mkdir(parents=True)
    (root / "fla" / "__init__.py").write_text(body)
    (root / "fla" / "ops" / "__init__.py").write_text("")
    (ops / "__init__.py").write_text(
        "def chunk_gated_delta_rule(*args, **kwargs):\n    raise AssertionError('the fake FLA kernel was called')\n"
    )
    if conv_args is not None:
        (root / "fla" / "modules").mkdir()
        (root / "fla" / "modules" / "__init__.py").write_text("")
        (root / "fla" / "modules" / "convolution.py").write_text(
            f"def causal_conv1d(x, weight=None, bias=None, {conv_args}):\n    raise AssertionError('the fake FLA conv was called')\n"
        )
    if version is not None:
        info = root / f"flash_linear_attention-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash-linear-attention\nVersion: {version}\n")


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """`tmp_path` on sys.path for this test, the probes' caches and the fake modules forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    kernels.reset()
    yield tmp_path
    for name in [n for n in sys.modules if n.split(".")[0] in ("fla", "causal_conv1d")]:
        del sys.modules[name]
    kernels.reset()


def test_fla_that_raises_on_import_is_reported_and_not_used(on_path):
    _fake_fla(on_path, "0.5.2", "raise ImportError('libcudart.so.13: cannot open shared object file')")
    found = kernels.fla_status()
    assert not found.usable and found.version == "0.5.2"
    assert found.reason.startswith("installed but does not import: ImportError: libcudart.so.13"), found.reason
    assert fla_kernel() is None and select_kernel(CUDA) is torch_kernel()
    # Transformers, deciding at its import, took its torch fallback (which raises on cu_seqlens):
    # packed rows must not be handed to it.
    assert not kernel_functions.varlen_kernel("fla", CUDA_TENSOR)


def test_causal_conv1d_that_raises_oserror_on_import_is_reported_and_not_used(on_path):
    (on_path / "causal_conv1d").mkdir()
    (on_path / "causal_conv1d" / "__init__.py").write_text(
        "raise OSError('causal_conv1d_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')"
    )
    found = kernels.conv_status()
    assert not found.usable and "does not import: OSError: causal_conv1d_cuda.so: undefined symbol" in found.reason
    assert select_conv_kernel(CUDA) is torch_conv_kernel
    assert not kernel_functions.varlen_kernel("causal_conv1d", CUDA_TENSOR)
    line = next(line for line in kernels.describe(cuda=True) if line.strip().startswith("causal-conv1d"))
    assert "does not import" in line


def test_fla_older_than_the_minimum_is_not_used_and_a_recent_one_is(on_path, tmp_path_factory, monkeypatch):
    _fake_fla(on_path, "0.4.0", "")
    found = kernels.fla_status()
    assert not found.usable and found.version == "0.4.0" and f"older than {kernels.MIN_FLA}" in found.reason
    assert fla_kernel() is None and select_kernel(CUDA) is torch_kernel()

    # The same package at 0.5.2 passes (the fake has no fla.utils: no Hopper backward check to fail).
    for name in [n for n in sys.modules if n.split(".")[0] == "fla"]:
        del sys.modules[name]
    newer = tmp_path_factory.mktemp("newer")
    _fake_fla(newer, "0.5.2", "")
    monkeypatch.syspath_prepend(str(newer))
    importlib.invalidate_caches()
    kernels.reset()
    found = kernels.fla_status()
    assert found.usable and found.version == "0.5.2", found
    assert select_kernel(CUDA) is found.function is fla_kernel()
    assert select_kernel(torch.device("cpu")) is torch_kernel()  # CPU tensors: torch, whatever is installed


def test_without_causal_conv1d_the_conv_takes_flas_triton_conv_where_it_takes_cu_seqlens(on_path, caplog):
    from qwen35_accel.ops.causal_conv import fla_conv_kernel

    _fake_fla(on_path, "0.6.0", "", conv_args="activation=None, cu_seqlens=None, **kwargs")
    found = kernels.fla_conv_status()
    assert found.usable and found.version == "0.6.0", found
    assert kernels.conv_package(CUDA) == "fla_conv" and select_conv_kernel(CUDA) is fla_conv_kernel
    assert kernels.conv_package(torch.device("cpu")) is None and select_conv_kernel(torch.device("cpu")) is torch_conv_kernel
    # Our layer without CP: FLA's conv instead of Transformers' torch fallback, packed rows through it with seq_idx.
    assert kernel_functions.kernel_function("causal_conv1d_fn", "causal_conv1d", CUDA_TENSOR) is fla_conv_kernel
    assert kernel_functions.varlen_kernel("causal_conv1d", CUDA_TENSOR)
    assert kernel_functions.kernel_function("causal_conv1d_update", "causal_conv1d", CUDA_TENSOR) is not fla_conv_kernel  # decoding keeps Transformers'
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        summary = kernels.run_summary(CUDA)
    assert "conv flash-linear-attention 0.6.0 (Triton conv)" in summary and "causal conv" not in caplog.text
    assert "GatedDeltaNet conv: FLA's Triton conv" in kernels.describe(cuda=True)

    # A causal-conv1d that imports and takes seq_idx comes first.
    (on_path / "causal_conv1d").mkdir()
    (on_path / "causal_conv1d" / "__init__.py").write_text("def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):\n    pass\n")
    kernels.reset()
    assert kernels.conv_package(CUDA) == "causal_conv1d" and select_conv_kernel(CUDA) is kernels.conv_status().function


def test_an_fla_conv_without_cu_seqlens_is_not_used(on_path):
    _fake_fla(on_path, "0.6.0", "", conv_args="activation=None")
    found = kernels.fla_conv_status()
    assert not found.usable and "takes no cu_seqlens" in found.reason
    assert select_conv_kernel(CUDA) is torch_conv_kernel


def test_documents_reach_flas_conv_as_cu_seqlens_over_the_flattened_rows():
    from qwen35_accel.ops.causal_conv import seq_idx_to_cu_seqlens

    seq_idx = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], dtype=torch.int32)  # a row starts a segment too
    assert seq_idx_to_cu_seqlens(seq_idx).tolist() == [0, 2, 5, 6, 8, 10]
    assert seq_idx_to_cu_seqlens(seq_idx).dtype == torch.int32


def test_cpu_tensors_take_flas_triton_kernels_only_in_interpreted_tests(monkeypatch):
    """The test helper's switch (`qwen35_accel.testing.interpreted_kernels`): CPU tensors go to FLA's
    Triton kernels only with it set and Triton interpreting; never to causal-conv1d's CUDA build."""
    cpu = torch.device("cpu")
    monkeypatch.delenv(kernels.TRITON_ON_CPU_VARIABLE, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert all(kernels.takes_kernel(p, CUDA) for p in ("fla", "fla_conv", "causal_conv1d"))
    assert not any(kernels.takes_kernel(p, cpu) for p in ("fla", "fla_conv", "causal_conv1d"))
    monkeypatch.setenv(kernels.TRITON_ON_CPU_VARIABLE, "1")
    assert not kernels.takes_kernel("causal_conv1d", cpu)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1 before triton is first imported"):
        kernels.takes_kernel("fla", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.takes_kernel("fla", cpu) and kernels.takes_kernel("fla_conv", cpu)
    assert not kernels.takes_kernel("causal_conv1d", cpu) and not kernels.takes_kernel("fla", torch.device("meta"))


@pytest.mark.parametrize("version", ["0.4.0", "0.5.2"])
def test_where_transformers_calls_fla_our_layer_takes_it_only_on_cuda_and_only_a_usable_one(on_path, version):
    """Transformers calls FLA whenever it imports, on any device (read from its wrapper; here
    set, since this process imported Transformers without FLA): our layer calls Transformers'
    function only for CUDA tensors and a usable FLA, else the torch function under it, which
    still refuses packed-row arguments as Transformers' fallback does."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    _fake_fla(on_path, version, "")
    real = kernels.transformers_uses
    kernels.transformers_uses = lambda package: package == "fla"  # restored below, before the fixture resets the caches
    try:
        name = "torch_chunk_gated_delta_rule"
        on_cuda = kernel_functions.kernel_function(name, "fla", CUDA_TENSOR)
        assert (on_cuda is getattr(hf, name)) == (version == "0.5.2")
        on_cpu = kernel_functions.kernel_function(name, "fla", torch.zeros(1))
        assert on_cpu is not getattr(hf, name) and kernels.unwrap_function(on_cpu) is kernels.unwrap_function(getattr(hf, name))
        with pytest.raises(ValueError, match="cannot keep packed documents apart"):
            on_cpu(*[torch.zeros(1, 4, 1, 2)] * 3, g=torch.zeros(1, 4, 1), beta=torch.ones(1, 4, 1), cu_seqlens=torch.tensor([0, 4]))
        # As resolved (the torch fallback), the plain function under Transformers' wrapper (a `kernels` Func module).
        conv = kernel_functions.kernel_function("causal_conv1d_fn", "causal_conv1d", CUDA_TENSOR)
        assert conv is not hf.causal_conv1d_fn and kernels.unwrap_function(conv) is kernels.unwrap_function(hf.causal_conv1d_fn)
    finally:
        kernels.transformers_uses = real


def test_a_cuda_run_without_the_kernels_warns_once_naming_why(caplog):
    kernels.reset()
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        select_kernel(CUDA), select_kernel(CUDA), select_conv_kernel(CUDA), select_conv_kernel(CUDA)
        summary = kernels.run_summary(CUDA)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "gated delta rule runs in plain torch on CUDA" in warnings[0] and "flash-linear-attention" in warnings[0]
    assert "causal conv runs in plain torch on CUDA" in warnings[1] and "causal-conv1d" in warnings[1]
    assert "flash-linear-attention conv: not installed" in warnings[1]  # FLA's Triton conv, the second choice
    assert summary == ("rule torch (flash-linear-attention: not installed), "
                       "conv torch (causal-conv1d: not installed; flash-linear-attention conv: not installed)")
    assert kernels.run_summary(torch.device("cpu")).startswith("torch (CPU run")
    kernels.reset()


def test_transformers_calling_an_fla_too_old_for_us_gets_the_torch_rule_in_our_layers_and_env_says_so(tmp_path):
    """In a fresh process (Transformers decides at its import) with FLA 0.4.0 importable:
    Transformers' own layer calls it; ours do not, and `env` names the package, the version
    and why it is not used."""
    _fake_fla(tmp_path, "0.4.0", "")
    script = textwrap.dedent(
        """
        import contextlib, io, json, torch
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
        from qwen35_accel.env import env, print_env
        from qwen35_accel.model.fp32_gate import install_fp32_gate
        from qwen35_accel.ops import kernels
        from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

        model = build_tiny_causal_lm(seed=0)
        install_fp32_gate(model)
        batch = random_batch(1, 16, model.config.vocab_size, seed=1)
        model(**batch).loss.backward()  # the fake FLA kernel raises if called
        try:
            build_tiny_causal_lm(seed=0)(**batch)
            stock = "ran"
        except AssertionError as exc:
            stock = str(exc)
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            print_env(env())
        print(json.dumps({"transformers_uses": kernels.transformers_uses("fla"), "stock": stock,
                          "rule": kernels.avoid_transformers_kernel("fla"), "env": text.getvalue()}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]),
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["transformers_uses"] is True and out["rule"] is True
    import transformers
    from packaging.version import Version

    # The unmodified model calls it; Transformers >= 5.25 sends CPU inputs to its torch rule itself.
    stock_on_cpu = "ran" if Version(transformers.__version__).release >= (5, 25) else "the fake FLA kernel was called"
    assert out["stock"] == stock_on_cpu
    env_text = out["env"]
    assert "kernels (cpu):" in env_text and "CPU run: the torch kernels run" in env_text
    assert f"flash-linear-attention 0.4.0: NOT used (older than {kernels.MIN_FLA}" in env_text, env_text
    assert "Transformers calls flash-linear-attention here; qwen35_accel's layers take torch instead" in env_text
    assert "causal-conv1d not installed: NOT used (not installed)" in env_text
