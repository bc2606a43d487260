"""The Accelerate plugin: settings, patch points, and `Accelerator.prepare` on CPU/gloo.

Multi-process tests build a real `Accelerator` (FSDP2 plugin, ParallelismConfig) in each
gloo rank, exactly as `accelerate launch` would configure it, and compare training with
the single-process Transformers model.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from qwen35_accel.parallel.prepared import prepared_by_accelerate
from _parity import AdamWeightTolerance, assert_close, assert_grads_match, assert_params_match, assert_params_match_after_adam


def test_settings_defaults_env_and_errors():
    from qwen35_accel.settings import PluginSettings

    assert PluginSettings.from_env({}) == PluginSettings()
    s = PluginSettings.from_env({"QWEN35_ACCEL": "0", "QWEN35_ACCEL_FSDP2_BACKWARD_PREFETCH_DEPTH": "3"})
    assert not s.enabled and s.parallel.fsdp2_backward_prefetch_depth == 3
    with pytest.raises(ValueError, match=r"QWEN35_ACCEL_FROZEN_MULTIMODAL_SHARDING='all': expected one of \['root', 'replicate', 'shard'\]"):
        PluginSettings.from_env({"QWEN35_ACCEL_FROZEN_MULTIMODAL_SHARDING": "all"})
    assert PluginSettings.from_env({"QWEN35_ACCEL_CP_STATE_EXCHANGE": "Scan"}).parallel.cp_state_exchange == "scan"
    with pytest.raises(ValueError, match=r"QWEN35_ACCEL_CP_STATE_EXCHANGE='ring': expected one of \['auto', 'allgather', 'scan'\]"):
        PluginSettings.from_env({"QWEN35_ACCEL_CP_STATE_EXCHANGE": "ring"})
    with pytest.raises(ValueError, match=r"QWEN35_ACCEL_CPU_FSDP='maybe': expected one of \[.*'0'.*'true'"):
        PluginSettings.from_env({"QWEN35_ACCEL_CPU_FSDP": "maybe"})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['QWEN35_ACCEL_CPUFSDP'\]; qwen35_accel reads \[.*'QWEN35_ACCEL_CPU_FSDP'"):
        PluginSettings.from_env({"QWEN35_ACCEL_CPUFSDP": "1"}, strict=True)
    # The kernel selection's Triton knob, which the interpreted-kernel tests set, is a declared setting: a
    # preparation with it set does not refuse it as unknown.
    from qwen35_accel.ops.kernels import TRITON_ON_CPU_VARIABLE

    assert PluginSettings.from_env({TRITON_ON_CPU_VARIABLE: "1"}, strict=True).triton_on_cpu is True


def test_the_prepared_line_names_the_mixed_precision_in_effect_and_a_script_that_overrode_the_launch_config():
    """ms-swift sets fp16=True by default: its units then compute in fp16 while the YAML says 'no'."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from qwen35_accel.integrations.prepared_line import mixed_precision_note

    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    note = mixed_precision_note("fp16", fp16, {"ACCELERATE_MIXED_PRECISION": "no"})
    assert note == ("mixed precision: fp16 (units compute in float16, reduce in float32; gate holders fp32), set by the "
                    "script (TrainingArguments fp16/bf16 or Accelerator(mixed_precision=...)) over the launch config's 'no'")
    assert mixed_precision_note("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16), {"ACCELERATE_MIXED_PRECISION": "bf16"}) == (
        "mixed precision: bf16 (units compute in bfloat16, reduce in bfloat16; gate holders fp32)")
    assert mixed_precision_note("no", MixedPrecisionPolicy(), {}) == (
        "mixed precision: no (units compute in their storage dtype, reduce in their storage dtype; gate holders fp32)")


def test_every_variable_the_package_names_is_a_declared_setting():
    """A `QWEN35_ACCEL_*` name written anywhere in the package is one `PluginSettings` declares (and
    docs/configuration.md lists, test_docs): no knob read behind the settings' back."""
    import re
    from pathlib import Path

    import qwen35_accel
    from qwen35_accel.settings import knobs

    declared = {knob.variable for knob in knobs()}
    named = {
        name
        for path in Path(qwen35_accel.__file__).parent.rglob("*.py")
        for name in re.findall(r"[\"'](QWEN35_ACCEL(?:_[A-Z0-9_]+)?)[\"']", path.read_text())
    }
    assert "QWEN35_ACCEL_TRITON_ON_CPU" in named and named <= declared, sorted(named - declared)


def test_tiled_loss_setting_takes_its_modes_and_its_former_boolean_spellings():
    from qwen35_accel.settings import PluginSettings

    from qwen35_accel.parallel.tiled_head import DEFAULT_LOSS_MODE

    assert PluginSettings().parallel.tiled_loss == DEFAULT_LOSS_MODE == "recompute"
    spellings = {"1": "recompute", "true": "recompute", "0": "off", "False": "off", "off": "off", "Hold": "hold"}
    for raw, mode in spellings.items():
        assert PluginSettings.from_env({"QWEN35_ACCEL_TILED_LOSS": raw}).parallel.tiled_loss == mode, raw
    with pytest.raises(ValueError, match=r"QWEN35_ACCEL_TILED_LOSS='keep': expected one of \['off', 'recompute', 'hold'\]"):
        PluginSettings.from_env({"QWEN35_ACCEL_TILED_LOSS": "keep"})


def _all_active_but_deepspeeds_waiting(points: list[dict]) -> bool:
    """Every point active, DeepSpeed's active or waiting for their modules (Accelerate imports them for a
    DeepSpeed run; absent without the deepspeed extra)."""
    from qwen35_accel.integrations.deepspeed.deepspeed_points import DEEPSPEED_POINTS

    deepspeed = [p for p in points if p["target"].startswith("deepspeed.")]
    return len(deepspeed) == len(DEEPSPEED_POINTS) == 6 and all(p["active"] or p["deferred"] for p in deepspeed) and all(
        p["active"] for p in points if p not in deepspeed
    )


def test_patch_points_install_idempotently_restore_and_respect_the_version_guard(monkeypatch):
    import accelerate
    import transformers.trainer
    import trl.trainer.dpo_trainer  # noqa: F401  (the modules of deferred points)
    import trl.trainer.grpo_trainer  # noqa: F401
    import trl.trainer.kto_trainer  # noqa: F401
    import trl.trainer.rloo_trainer  # noqa: F401
    import trl.trainer.sft_trainer  # noqa: F401
    from accelerate.accelerator import Accelerator

    from qwen35_accel.integrations import plugin

    plugin.install()  # the deferred Trainer and TRL points, now that their modules are imported
    assert hasattr(transformers.trainer.Trainer.save_model, "__qwen35_accel_original__")

    # The autoload (torch entry point) has already installed the plugin in this process.
    assert plugin.status()["active"], "the torch entry point did not activate the plugin"
    patched = Accelerator._prepare_fsdp2
    assert plugin.install() and Accelerator._prepare_fsdp2 is patched  # idempotent
    assert _all_active_but_deepspeeds_waiting(plugin.status()["patch_points"])

    plugin.uninstall()
    try:
        assert Accelerator._prepare_fsdp2 is patched.__qwen35_accel_original__
        assert not plugin.status()["active"]
        monkeypatch.setattr(accelerate, "__version__", "1.99.0")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert plugin.install() is False
        assert any("accelerate 1.99.0 is outside the tested range" in str(w.message) for w in caught)
        assert not plugin.status()["active"]
    finally:
        monkeypatch.undo()
        assert plugin.install()
    assert _all_active_but_deepspeeds_waiting(plugin.status()["patch_points"])


def _accelerator(world: int, cp: int, **plugin_kwargs):
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    return Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, **plugin_kwargs),
        parallelism_config=ParallelismConfig(dp_shard_size=world // cp, cp_size=cp),
    )


def _trainer_style_step(accelerator, model, batch, num_items):
    """What the Trainer does per step: CP context around forward and backward, loss =
    local sum / global count × num_processes (FSDP2 then averages over dp_shard_cp)."""
    inputs = dict(batch)
    buffers = [inputs[k] for k in ("input_ids", "labels", "shift_labels", "position_ids")]
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers)):
        loss = model(**inputs, num_items_in_batch=num_items).loss * accelerator.num_processes
        accelerator.backward(loss)
    return loss.detach()


def _prepare_and_train_worker(rank: int, world: int, cp: int, activation_checkpointing: bool) -> None:
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule

    from qwen35_accel.parallelization import mesh_dim_names
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    accelerator = _accelerator(world, cp, activation_checkpointing=activation_checkpointing)
    assert accelerator.distributed_type == DistributedType.FSDP, accelerator.distributed_type
    reference = build_tiny_causal_lm(seed=0)
    model = build_tiny_causal_lm(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # made before prepare, as the Trainer does
    model, optimizer = accelerator.prepare(model, optimizer)
    assert prepared_by_accelerate(model)
    assert isinstance(model.model.layers[0].linear_attn._fp32_params, FSDPModule)
    # Still FSDP after later AcceleratorState() calls (they copy PartialState's state).
    assert accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    adam = AdamWeightTolerance(lr=1e-3)

    dp = world // cp
    mesh = accelerator.torch_device_mesh
    dp_rank = mesh["dp_shard"].get_local_rank() if "dp_shard" in mesh_dim_names(mesh) else 0
    for step in range(3):
        batch = random_batch(2 * dp, 16, reference.config.vocab_size, seed=10 + step)
        batch["shift_labels"] = torch.cat([batch["labels"][:, 1:], torch.full((2 * dp, 1), -100)], dim=1)
        batch["position_ids"] = torch.arange(16).expand(2 * dp, 16)
        num_items = (batch["shift_labels"] != -100).sum()
        local = {k: v[2 * dp_rank : 2 * dp_rank + 2].clone() for k, v in batch.items()}
        loss = _trainer_style_step(accelerator, model, local, num_items)

        ref_loss = reference(**{k: batch[k] for k in ("input_ids", "labels")}).loss
        ref_loss.backward()
        reported = loss.clone()
        dist.all_reduce(reported, op=dist.ReduceOp.AVG)  # what the Trainer logs
        assert_close(reported, ref_loss.detach(), f"loss at step {step}")
        # fp32 rtol 1e-5 / atol 1e-6: FSDP2 (and CP) sum the gradients in another order.
        assert_grads_match(model, reference, atol=1e-6)
        adam.step_model(model, reference)
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
    assert_params_match_after_adam(model, reference, adam)
    # The full state dict Trainer.save_model uses: plain tensors, Transformers keys.
    full = accelerator.get_state_dict(model)
    if rank == 0:
        assert set(full) == set(reference.state_dict()) and all(type(v) is torch.Tensor for v in full.values())
        assert full["model.layers.0.linear_attn.A_log"].dtype == torch.float32


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world,cp,ac", [(2, 1, False), (2, 2, True), pytest.param(4, 2, False, marks=pytest.mark.slow)], ids=["dp2", "cp2-ac", "dp2xcp2"]
)
def test_accelerator_prepare_hands_qwen35_to_the_parallelizer_and_matches_single_process(world, cp, ac):
    run_world(_prepare_and_train_worker, world, cp, ac)


def _llama_worker(rank: int, world: int) -> None:
    from accelerate.accelerator import fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        return LlamaForCausalLM(config)

    accelerator = _accelerator(world, 1)
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert not prepared_by_accelerate(model)
    # The units Accelerate's own fsdp2_prepare_model gives when called directly.
    direct = fsdp2_prepare_model.__qwen35_accel_original__(accelerator, llama())
    units = lambda m: [n for n, sub in m.named_modules() if isinstance(sub, FSDPModule)]  # noqa: E731
    assert units(model) == units(direct) and len(units(model)) > 2
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.multiprocess
def test_other_models_take_accelerates_own_fsdp2_path():
    run_world(_llama_worker, 2)


def test_disabled_by_env_in_a_fresh_process():
    import subprocess
    import sys

    code = (
        "from accelerate.accelerator import Accelerator;"
        "print(hasattr(Accelerator._prepare_fsdp2, '__qwen35_accel_original__'))"
    )
    env = dict(os.environ, QWEN35_ACCEL="0")
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    env["QWEN35_ACCEL"] = "1"
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert (off.stdout.strip(), on.stdout.strip()) == ("False", "True")


def _ram_efficient_worker(rank: int, world: int) -> None:
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    accelerator = _accelerator(world, 1, cpu_ram_efficient_loading=True)
    reference = build_tiny_causal_lm(seed=0)
    # Only rank 0 holds the real weights (as Transformers loads them under this setting);
    # the other ranks start from different ones and must end with rank 0's.
    model = build_tiny_causal_lm(seed=0 if rank == 0 else 123)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert prepared_by_accelerate(model)
    assert_params_match(model, reference, atol=0)  # exact: preparing moves values, computes nothing
    batch = random_batch(2, 16, reference.config.vocab_size, seed=3)
    loss = model(**batch).loss
    accelerator.backward(loss)
    reference(**batch).loss.backward()
    assert_grads_match(model, reference)
    assert model.model.layers[0].linear_attn.A_log.dtype == torch.float32


@pytest.mark.multiprocess
def test_cpu_ram_efficient_loading_broadcasts_rank0_weights_into_the_sharded_model():
    run_world(_ram_efficient_worker, 2)


def _ram_efficient_tp_worker(rank: int, world: int, moe_ep: bool = False) -> None:
    """`moe_ep`: a MoE of 8 experts with QWEN35_ACCEL_EP=2 (ep x tp: each rank holds 2 experts
    whole, outside FSDP2, and gets them from rank 0's weights too)."""
    import os
    from functools import partial

    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_moe_causal_lm, random_batch
    from _parity import hf_name

    if moe_ep:
        os.environ["QWEN35_ACCEL_EP"] = "2"
    build = partial(build_tiny_moe_causal_lm, num_experts=8) if moe_ep else build_tiny_causal_lm
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True),
        parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2),
    )
    reference = build(seed=0)
    model = build(seed=0 if rank == 0 else 123)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
    finally:
        os.environ.pop("QWEN35_ACCEL_EP", None)
    assert model.model.layers[0].linear_attn.num_v_heads == reference.config.linear_num_value_heads // 2
    if moe_ep:
        assert model.model.layers[0].mlp.experts.num_experts == 2
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    expected = reference.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert_close(state[key], value, f"state_dict[{key}]", atol=0, rtol=0)  # exact: gathered copies
    replica = accelerator.torch_device_mesh["dp_shard"].get_local_rank()
    batch = random_batch(4, 16, reference.config.vocab_size, seed=3)
    loss = model(**{k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}).loss
    accelerator.backward(loss)
    reference(**batch).loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(gather_tensor_parallel(model, name, p.grad), ref_params[hf_name(name)].grad, f"grad of {name}")


@pytest.mark.multiprocess
@pytest.mark.slow  # world 4
@pytest.mark.parametrize("moe_ep", [False, True], ids=["dense", "moe-ep2xtp2"])
def test_cpu_ram_efficient_loading_under_tensor_parallelism(moe_ep):
    run_world(_ram_efficient_tp_worker, 4, moe_ep)


def _save_load_state_tp_worker(rank: int, world: int, state_dict_type: str, tmp: str, moe_ep: bool = False) -> None:
    """`moe_ep`: a MoE of 8 experts under QWEN35_ACCEL_EP=2 (ep x tp: the held experts' weights and
    AdamW state in the checkpoint) instead of the dense model."""
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_moe_causal_lm, random_batch

    vocab_parallel = state_dict_type == "SHARDED_STATE_DICT" and not moe_ep  # and the lm_head's slices in the checkpoint
    knob = ("QWEN35_ACCEL_EP", "2") if moe_ep else ("QWEN35_ACCEL_VOCAB_PARALLEL_LM_HEAD", "1") if vocab_parallel else None
    if knob:
        os.environ[knob[0]] = knob[1]
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type),
        parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2),
    )
    model = build_tiny_moe_causal_lm(seed=0, num_experts=8) if moe_ep else build_tiny_causal_lm(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    if knob:
        del os.environ[knob[0]]
    if moe_ep:
        assert model.model.layers[0].mlp.experts.num_experts == 2
    replica = accelerator.torch_device_mesh["dp_shard"].get_local_rank()
    local_vocab = model.lm_head.weight.shape[0]
    assert local_vocab == (model.config.vocab_size // 2 if vocab_parallel else model.config.vocab_size)

    def step(i):
        batch = random_batch(4, 16, model.config.vocab_size, seed=30 + i)
        loss = model(**{k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def weights():
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in model.state_dict().items()}

    step(0)
    accelerator.save_state(tmp)
    expected = [step(1), step(2)]
    final = weights()
    accelerator.load_state(tmp)  # back to after step 0: weights and AdamW state
    # Same layout before and after load_state: one reduction order; 1e-6 for safety.
    for i, want in zip((1, 2), expected):
        assert_close(step(i), want, f"loss at step {i} after load_state", rtol=1e-6)
    for key, value in weights().items():
        assert_close(value, final[key], f"{key} after load_state", rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
@pytest.mark.slow  # world 4
@pytest.mark.parametrize("state_dict_type,moe_ep", [("FULL_STATE_DICT", False), ("SHARDED_STATE_DICT", False),
                                                    ("SHARDED_STATE_DICT", True)], ids=["full", "sharded", "sharded-moe-ep2xtp2"])
def test_save_and_load_state_under_tensor_parallelism(tmp_path, state_dict_type, moe_ep):
    run_world(_save_load_state_tp_worker, 4, state_dict_type, str(tmp_path), moe_ep)


def _bf16_accelerate_worker(rank: int, world: int) -> None:
    from qwen35_accel.parallel.fsdp import describe_units
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = build_tiny_causal_lm(seed=0, dtype=torch.bfloat16)  # a bf16 checkpoint
    for layer in model.model.layers:
        if layer.block_type == "linear_attention":  # whose gate parameters were kept fp32
            layer.linear_attn.A_log.data = layer.linear_attn.A_log.data.float()
            layer.linear_attn.dt_bias.data = layer.linear_attn.dt_bias.data.float()
    reference = copy.deepcopy(model)  # a frozen reference of the same checkpoint, as TRL's trainers hold one
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, reference = accelerator.prepare(model, optimizer, reference)
    for prepared, storage in ((model, "float32"), (reference, "bfloat16")):
        rows = {r["unit"]: r for r in describe_units(prepared)}
        # The policy as stock Accelerate: fp32 master weights, bf16 compute; the reference (no optimizer)
        # kept bf16, as TRL's prepare_fsdp keeps it. The gate holders compute in fp32.
        assert (rows["model.layers.0"]["storage"], rows["model.layers.0"]["compute"]) == (storage, "bfloat16")
        holder = rows["model.layers.0.linear_attn._fp32_params"]
        assert (holder["storage"], holder["compute"]) == ("float32", "float32")
    batch = random_batch(2, 16, model.config.vocab_size, seed=rank)
    loss = model(**batch).loss
    with torch.no_grad():  # the same bf16 values computed from bf16 or from fp32 storage
        assert torch.equal(reference(**batch).loss, loss.detach())
    accelerator.backward(loss)
    optimizer.step()
    assert torch.isfinite(loss)


@pytest.mark.multiprocess
def test_accelerate_bf16_mixed_precision_keeps_the_gate_in_fp32():
    run_world(_bf16_accelerate_worker, 2)


def test_the_wheel_carries_the_autoload_module_and_its_torch_entry_point(tmp_path):
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(root)],
        check=True, capture_output=True, timeout=300,
    )
    wheel = next(tmp_path.glob("qwen35_accel-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "qwen35_accel_autoload.py" in names and "qwen35_accel/integrations/plugin.py" in names
    assert {f"qwen35_accel/integrations/{sub}/{sub}_points.py" for sub in ("accelerate", "trl")} <= set(names)
    assert "qwen35_accel/integrations/transformers/trainer_points.py" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[torch.backends]\nqwen35_accel = qwen35_accel_autoload:activate" in entry_points
    assert "qwen35-accel = qwen35_accel.cli:main" in entry_points


def test_activation_when_the_trainer_module_imports_accelerate_first():
    # `from transformers import Trainer` as a script's first import: Accelerate is
    # imported while transformers.trainer is still half-initialised; the plugin must
    # patch Accelerate then and the Trainer point later, with no warning.
    import subprocess
    import sys

    code = (
        "import warnings; warnings.simplefilter('error', UserWarning)\n"
        "import transformers.trainer\n"
        "from accelerate.accelerator import Accelerator\n"
        "import qwen35_accel.integrations.plugin as plugin\n"
        "assert hasattr(Accelerator._prepare_fsdp2, '__qwen35_accel_original__')\n"
        "plugin.install()\n"
        "assert hasattr(transformers.trainer.Trainer.save_model, '__qwen35_accel_original__')\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, QWEN35_ACCEL="1"))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def _fsdp1_worker(rank: int, world: int) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM

    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1))
        # No accelerator: FSDP1 has no CPU path, so it stays Accelerate's MULTI_CPU (before: the plugin made it FSDP
        # and FSDP1 crashed on "Inconsistent compute device and device_id on rank 0: cpu vs cpu:0").
        assert accelerator.distributed_type == DistributedType.MULTI_CPU
        with pytest.raises(ValueError, match=r"Qwen3_5ForCausalLM under FSDP v1 .*`accelerate to-fsdp2 --config_file"):
            accelerator.prepare(build_tiny_causal_lm(seed=0))
        llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2))
        accelerator.prepare(llama)  # another model: stock (DDP here)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    dist.barrier()


@pytest.mark.multiprocess
def test_fsdp1_is_refused_for_qwen35_on_every_rank_and_left_stock_for_other_models(monkeypatch):
    """FSDP v1 (issue 60): a Qwen3.5 model is refused with the reason and the command that converts the YAML;
    another model keeps Accelerate's path; on CPU no crash from the plugin's CPU backend."""
    run_world(_fsdp1_worker, 2)
