"""The gate fix where no FSDP runs: Accelerate preparing a dense Qwen3.5 model in one process or
under DDP holds `A_log`/`dt_bias` in fp32 (the checkpoint's values after a bf16 load), trains
and saves them in fp32; `QWEN35_ACCEL_FP32_GATES=0` leaves them as loaded (stock: bf16 gates
after a bf16 load, trained and saved bf16-rounded, silently)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _launched import Run, register
from test_bf16_load import _save_source, assert_rounded_on_load, checkpoint_gate_values, save_fp32

from qwen35_accel.testing.launch import RECIPE, describe, run_launch
from qwen35_accel.testing.local_world import free_port
from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

PREPARED = "prepared by qwen35_accel without FSDP"


def _prepare_one_process(directory: Path, **accelerator_kwargs):
    """A bf16 load of `directory` and an SGD optimizer made from it, prepared by a fresh
    one-process Accelerator (the plugin's patch points installed)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from qwen35_accel import install

    install()
    AcceleratorState._reset_state(reset_partial_state=True)
    model = type(build_tiny_causal_lm()).from_pretrained(directory, dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # before prepare, as the Trainer and most loops do
    accelerator = Accelerator(cpu=True, **accelerator_kwargs)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _gates(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if name.endswith((".A_log", ".dt_bias"))}


def test_one_process_holds_trains_and_saves_the_checkpoints_fp32_gates_under_bf16_autocast(tmp_path, capfd):
    saved = save_fp32(build_tiny_causal_lm, tmp_path / "checkpoint")
    try:
        accelerator, model, optimizer = _prepare_one_process(tmp_path / "checkpoint", mixed_precision="bf16")
        assert PREPARED in capfd.readouterr().err
        gates = _gates(model)
        assert set(gates) == set(saved)
        for name, value in saved.items():  # held in fp32, the checkpoint's values bitwise
            assert gates[name].dtype == torch.float32 and torch.equal(gates[name].detach(), value), name
        # The optimizer made before prepare still holds the same Parameter objects.
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert all(id(p) in held for p in gates.values())
        before = {name: p.detach().clone() for name, p in gates.items()}
        loss = model(**random_batch(2, 16, model.config.vocab_size, seed=0)).loss
        accelerator.backward(loss)
        for name, p in gates.items():  # fp32 gradients, the update applied in fp32
            assert p.grad is not None and p.grad.dtype == torch.float32, name
        optimizer.step()
        for name, p in gates.items():
            assert torch.equal(p.detach(), before[name] - 0.5 * p.grad), name
        # Trained in fp32: the updated gates are not what bf16 storage could hold.
        assert any(not torch.equal(p.detach(), p.detach().bfloat16().float()) for p in gates.values())
        accelerator.unwrap_model(model).save_pretrained(tmp_path / "trained")
        trained = checkpoint_gate_values(tmp_path / "trained")
        for name, p in gates.items():
            assert trained[name].dtype == torch.float32 and torch.equal(trained[name], p.detach()), name
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


def test_lora_on_one_process_computes_from_the_checkpoints_fp32_gates(tmp_path, capfd):
    """LoRA on one GPU, the most common fine-tune: PEFT freezes the gates, and after a bf16 load
    they take the checkpoint's fp32 values back at prepare, so every forward computes the decay
    from what Qwen trained."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from peft import LoraConfig, get_peft_model

    from qwen35_accel import install

    saved = save_fp32(build_tiny_causal_lm, tmp_path / "checkpoint")
    install()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        base = type(build_tiny_causal_lm()).from_pretrained(tmp_path / "checkpoint", dtype=torch.bfloat16)
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "in_proj_qkv"]))
        model = Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
        assert PREPARED in capfd.readouterr().err
        gates = {name.removeprefix("base_model.model."): p for name, p in _gates(model).items()}
        assert set(gates) == set(saved)
        for name, value in saved.items():
            assert not gates[name].requires_grad and gates[name].dtype == torch.float32 and torch.equal(gates[name], value), name
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_fp32_gates_off_leaves_the_gates_as_loaded(tmp_path, monkeypatch, capfd):
    saved = save_fp32(build_tiny_causal_lm, tmp_path / "checkpoint")
    monkeypatch.setenv("QWEN35_ACCEL_FP32_GATES", "0")
    try:
        _, model, _ = _prepare_one_process(tmp_path / "checkpoint")
        assert PREPARED not in capfd.readouterr().err
        assert_rounded_on_load(model, saved)  # bf16, as loaded
        assert all(p.dtype == torch.bfloat16 for p in _gates(model).values())
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


# The recipe (an unchanged Trainer script), bf16 load of its tiny model saved in fp32, 2 SGD steps.
TRAIN = ("--max_steps", "2", "--optim", "sgd", "--learning_rate", "0.3", "--per_device_train_batch_size", "1",
         "--seed", "0", "--dtype", "bfloat16", "--model_name_or_path", "{in}", "--tokenizer_name_or_path",
         str(RECIPE.parent / "configs" / "tokenizer"), "--save_strategy", "no", "--report_to", "none")
register(**{"gates/one-process": Run(None, RECIPE, (*TRAIN, "--output_dir", "{out}"), setup=_save_source)})


def assert_trained_in_fp32(source: Path, out: Path) -> None:
    saved, trained = checkpoint_gate_values(source), checkpoint_gate_values(out)
    assert set(trained) == set(saved)
    assert all(v.dtype == torch.float32 for v in trained.values()), {k: v.dtype for k, v in trained.items()}
    assert any(not torch.equal(trained[k], saved[k]) for k in saved)  # they trained
    assert any(not torch.equal(v, v.bfloat16().float()) for v in trained.values())  # not bf16-rounded


@pytest.mark.slow
@pytest.mark.launches("gates/one-process")
def test_a_trainer_in_one_process_trains_the_gates_in_fp32_after_a_bf16_load(launched):
    result = launched("gates/one-process")
    assert f"Qwen3_5ForCausalLM {PREPARED} (one process)" in result.stderr, result.stderr[-3000:]
    assert "their fp32 values were read back, bitwise" in result.stderr
    assert_trained_in_fp32(result.inputs, result.out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_trainer_under_ddp_trains_the_gates_in_fp32_after_a_bf16_load(tmp_path):
    """torchrun, 2 processes, no FSDP: the Trainer's Accelerator wraps the model in DDP (gloo)."""
    source = tmp_path / "source"
    _save_source(source)
    args = [a.replace("{in}", str(source)) for a in TRAIN]
    result = run_launch(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(RECIPE), *args, "--use_cpu", "True", "--output_dir", str(tmp_path / "out")]
    )
    assert result.returncode == 0 and not result.leftover_processes, describe(result)
    assert result.stderr.count(f"Qwen3_5ForCausalLM {PREPARED} (DDP)") == 1, describe(result)  # rank 0, once
    assert_trained_in_fp32(source, tmp_path / "out")


def test_a_model_loaded_in_fp32_is_left_to_transformers(tmp_path, capfd):
    """fp32 gates: Transformers' layer computes the gate in fp32 under any autocast and the
    optimizer updates fp32 storage; nothing to fix, so the model stays the unmodified one."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    save_fp32(build_tiny_causal_lm, tmp_path / "checkpoint")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from qwen35_accel import install

    install()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        model = type(build_tiny_causal_lm()).from_pretrained(tmp_path / "checkpoint", dtype=torch.float32)
        model = Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
        assert PREPARED not in capfd.readouterr().err
        assert all(type(m) is hf.Qwen3_5GatedDeltaNet for m in model.modules() if isinstance(m, hf.Qwen3_5GatedDeltaNet))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
