"""fp32 gates from bf16 loads: `install_fp32_gate` takes `A_log`/`dt_bias` back from the
checkpoint a bf16 model was loaded from, bitwise, or warns once when it cannot."""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from _dist import run_world
from _launched import Run, register
from safetensors import safe_open
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from qwen35_accel.model import checkpoint_gates
from qwen35_accel.model.fp32_gate import install_fp32_gate
from qwen35_accel.testing.launch import RECIPE, describe
from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_vlm

GATES = (".A_log", ".dt_bias")
ROUNDED = "hold torch.bfloat16 values"  # the warning's subject


@pytest.fixture(autouse=True)
def _fresh_warnings():
    checkpoint_gates._warned.clear()  # "once per process": each test starts from a fresh process's state


def checkpoint_gate_values(directory: Path) -> dict[str, torch.Tensor]:
    """Every gate tensor of a saved checkpoint (single file or shards), as stored."""
    values = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            values.update({k: f.get_tensor(k) for k in f.keys() if k.endswith(GATES)})
    return values


def model_gate_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items() if k.endswith(GATES)}


def save_fp32(build, directory: Path, **save_kwargs) -> dict[str, torch.Tensor]:
    build(seed=1).save_pretrained(directory, **save_kwargs)
    saved = checkpoint_gate_values(directory)
    assert saved and all(v.dtype == torch.float32 for v in saved.values())
    return saved


def assert_rounded_on_load(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Precondition: the load rounded every gate (so the restore has something to fix)."""
    loaded = model_gate_values(model)
    assert all(v.dtype == torch.bfloat16 for v in loaded.values())
    assert all(not torch.equal(loaded[k].float(), saved[k]) for k in saved)


def assert_checkpoint_values(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    values = model_gate_values(model)
    assert set(values) == set(saved)
    for key, value in saved.items():
        assert values[key].dtype == torch.float32 and torch.equal(values[key], value), key


@pytest.mark.parametrize("sharded", [False, True], ids=["single_file", "sharded"])
@pytest.mark.parametrize("build", [build_tiny_causal_lm, build_tiny_vlm], ids=["causal_lm", "vlm"])
def test_bf16_load_of_an_fp32_checkpoint_ends_with_the_checkpoints_gates(tmp_path, build, sharded, caplog):
    saved = save_fp32(build, tmp_path, **({"max_shard_size": "20KB"} if sharded else {}))
    assert (tmp_path / checkpoint_gates.INDEX_FILE).exists() == sharded
    model = type(build()).from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert_rounded_on_load(model, saved)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger=checkpoint_gates.__name__):
        warnings.simplefilter("error")
        assert install_fp32_gate(model) == 2
    assert_checkpoint_values(model, saved)
    [line] = [r.getMessage() for r in caplog.records if r.name == checkpoint_gates.__name__]
    assert f"restored {len(saved)} GatedDeltaNet gate parameters" in line and str(tmp_path) in line


def test_dtype_auto_on_a_bf16_config_restores_the_gates(tmp_path):
    saved = save_fp32(build_tiny_causal_lm, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dtype"] = "bfloat16"  # the published checkpoints' config: "auto" then loads in bf16
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = hf.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert_rounded_on_load(model, saved)
    install_fp32_gate(model)
    assert_checkpoint_values(model, saved)


def test_causal_lm_loaded_from_a_vlm_checkpoint_finds_the_language_model_keys(tmp_path):
    saved = save_fp32(build_tiny_vlm, tmp_path)
    assert all(k.startswith("model.language_model.layers.") for k in saved)
    model = hf.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    install_fp32_gate(model)
    # Transformers' conversion: model.language_model.layers.N… -> model.layers.N…
    renamed = {k.replace("model.language_model.", "model."): v for k, v in saved.items()}
    assert_checkpoint_values(model, renamed)


def test_a_lora_wrapped_bf16_load_restores_the_base_models_gates(tmp_path):
    from peft import LoraConfig, get_peft_model

    saved = save_fp32(build_tiny_causal_lm, tmp_path)
    base = hf.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["in_proj_qkv", "q_proj"]))
    install_fp32_gate(model)  # as PARALLELIZER.apply and the plugin do: the outer module
    assert_checkpoint_values(base, saved)


def test_a_hub_id_is_read_from_the_hugging_face_cache_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    saved = save_fp32(build_tiny_causal_lm, tmp_path / "saved")
    repo = tmp_path / "hub" / "models--someone--tiny-qwen35"  # the cache's layout
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tmp_path / "saved", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = hf.Qwen3_5ForCausalLM.from_pretrained("someone/tiny-qwen35", dtype=torch.bfloat16, cache_dir=tmp_path / "hub")
    assert model.name_or_path == "someone/tiny-qwen35"
    install_fp32_gate(model)
    assert_checkpoint_values(model, saved)


def test_a_bf16_checkpoint_has_nothing_to_restore_and_says_nothing(tmp_path):
    build_tiny_causal_lm(seed=1, dtype=torch.bfloat16).save_pretrained(tmp_path)
    saved = checkpoint_gate_values(tmp_path)
    assert all(v.dtype == torch.bfloat16 for v in saved.values())
    model = hf.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        install_fp32_gate(model)
    assert_checkpoint_values(model, {k: v.float() for k, v in saved.items()})


def test_fp32_and_meta_models_are_left_alone(tmp_path):
    save_fp32(build_tiny_causal_lm, tmp_path)
    with torch.device("meta"):  # cpu_ram_efficient_loading's other ranks: rank 0 broadcasts later
        meta = hf.Qwen3_5ForCausalLM(hf.Qwen3_5ForCausalLM.config_class.from_pretrained(tmp_path)).to(torch.bfloat16)
    meta.name_or_path = str(tmp_path)
    fp32 = hf.Qwen3_5ForCausalLM.from_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        install_fp32_gate(meta)
        install_fp32_gate(fp32)
    assert meta.model.layers[0].linear_attn.A_log.is_meta


def test_a_model_without_a_source_warns_once_how_to_load_in_fp32():
    model = build_tiny_causal_lm(dtype=torch.bfloat16)  # built from a config: no checkpoint to read
    with pytest.warns(UserWarning) as record:
        install_fp32_gate(model)
        install_fp32_gate(build_tiny_causal_lm(seed=1, dtype=torch.bfloat16))  # same problem: said already
    [warning] = [w for w in record if ROUNDED in str(w.message)]
    message = str(warning.message)
    assert "4 GatedDeltaNet gate parameters (A_log/dt_bias) hold torch.bfloat16 values" in message
    assert "`name_or_path` is empty" in message
    assert "relative error up to 2^-8 = 3.9e-03" in message
    assert "from_pretrained(..., dtype=torch.float32)" in message and "mixed precision" in message
    assert warning.filename == __file__  # attributed to the caller of install_fp32_gate


def test_gates_changed_after_loading_are_kept_and_warned_about(tmp_path):
    saved = save_fp32(build_tiny_causal_lm, tmp_path)
    model = hf.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.layers[0].linear_attn.A_log.add_(1.0)
    changed = model.model.layers[0].linear_attn.A_log.detach().float().clone()
    with pytest.warns(UserWarning, match="is not the model's value") as record:
        install_fp32_gate(model)
    assert sum(ROUNDED in str(w.message) for w in record) == 1
    assert torch.equal(model.model.layers[0].linear_attn.A_log.detach(), changed)
    assert torch.equal(model.model.layers[0].linear_attn.dt_bias.detach(), saved["model.layers.0.linear_attn.dt_bias"])


def _apply_worker(rank: int, world: int, directory: str, dp: int, tp: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER

    mesh = init_device_mesh("cpu", (1, dp, 1, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = hf.Qwen3_5ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    PARALLELIZER.apply(model, mesh)
    assert_checkpoint_values(model, checkpoint_gate_values(Path(directory)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)], ids=["dp2", "tp2"])
def test_parallelizer_apply_on_a_bf16_load_holds_the_checkpoints_gates(tmp_path, dp, tp):
    # The tiny heads (attention 4/2, GatedDeltaNet 2/4) all divide by tp 2.
    save_fp32(build_tiny_causal_lm, tmp_path)
    run_world(_apply_worker, 2, str(tmp_path), dp, tp)


def _save_source(path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(RECIPE.parent / "configs" / "tiny_qwen35.json")).save_pretrained(path)


# cpu_fsdp2.yaml with fsdp_cpu_ram_efficient_loading as under test (FSDP_CPU_RAM_EFFICIENT_LOADING, what the key
# sets). One SGD step at learning rate 0: the saved model holds the weights the prepared model started from.
RAM_EFFICIENT = {"loaded_on_every_rank": "false", "cpu_ram_efficient_loading": "true"}
register(**{
    f"bf16/{case}": Run(
        "cpu_fsdp2.yaml", RECIPE,
        ("--max_steps", "1", "--optim", "sgd", "--learning_rate", "0", "--per_device_train_batch_size", "1", "--seed", "0",
         "--dtype", "bfloat16", "--model_name_or_path", "{in}", "--tokenizer_name_or_path",
         str(RECIPE.parent / "configs" / "tokenizer"), "--output_dir", "{out}"),
        env={"FSDP_CPU_RAM_EFFICIENT_LOADING": flag}, setup=_save_source,
    )
    for case, flag in RAM_EFFICIENT.items()
})


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.launches(f"bf16/{case}")) for case in RAM_EFFICIENT])
def test_the_plugin_trains_from_the_checkpoints_gates_after_a_bf16_load(launched, case):
    result = launched(f"bf16/{case}")
    saved = checkpoint_gate_values(result.inputs)
    assert "prepared by qwen35_accel" in result.stderr and ROUNDED not in result.stderr, describe(result.launch)
    assert "their fp32 values were read back, bitwise, from" in result.stderr, describe(result.launch)  # the plugin's one line
    trained = checkpoint_gate_values(result.out)
    assert set(trained) == set(saved)
    for key, value in saved.items():
        assert trained[key].dtype == torch.float32 and torch.equal(trained[key], value), key
