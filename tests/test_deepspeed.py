"""DeepSpeed ZeRO-2 and ZeRO-3 with the plugin (docs/deepspeed.md), launched as a user launches them on
CPU (gloo; `DS_BUILD_OPS=0`): the unchanged recipe through the Trainer in fp32 against one process and
in bf16 under ZeRO-3, and an Accelerate loop in bf16, from a checkpoint as Qwen ships it (bf16 weights, fp32
gates). Needs the
`deepspeed` extra (CI's DeepSpeed step: `python3 -m pytest -m deepspeed`); skipped elsewhere. On main
before this work no DeepSpeed launch on CPU got past DeepSpeed's batch-size check (one process per rank),
and on a GPU the gates were bf16 parameters of the engine under bf16.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from _launched import Run, register
from _parity import assert_same_log_history
from safetensors.torch import load_file
from test_moe_launch import MOE, save_tiny_moe
from test_reward_models import PREPARED as REWARD_PREPARED
from test_reward_models import SCRIPT as REWARD_SCRIPT
from test_reward_models import save_tiny_reward_model
from test_torchrun_launch import SCRIPT as TORCHRUN_SCRIPT
from test_trainer_launch import FIXED_LENGTH, RESUME_FROM, SGD, assert_same_training, losses, recipe_run

from qwen35_accel.testing.launch import accelerate_launch_command, assert_refused_on_every_rank, describe, run_launch
from qwen35_accel.testing.local_world import free_port

pytestmark = [
    pytest.mark.deepspeed, pytest.mark.multiprocess, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason='deepspeed not installed (pip install -e ".[deepspeed]")'),
]

CONFIGS = Path(__file__).parent / "configs"
LOOP = Path(__file__).parent / "scripts" / "deepspeed_loop.py"
TOKENIZER = str(Path(__file__).parent.parent / "recipes" / "configs" / "tokenizer")
DS_ENV = {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}
GATES = ("A_log", "dt_bias")


def save_tiny_fp32(path: Path) -> None:
    """The tiny dense model at the recipe's byte-level vocabulary, fp32 throughout."""
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    build_tiny_causal_lm(seed=0, vocab_size=264, eos_token_id=256, pad_token_id=256).save_pretrained(path)


def save_as_shipped(path: Path) -> None:
    """As Qwen ships a checkpoint: bf16 weights, `A_log`/`dt_bias` fp32."""
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(seed=1, vocab_size=264, eos_token_id=256, pad_token_id=256)
    gates = {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith(GATES)}
    model.to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in gates:
                p.data = gates[name]
    model.save_pretrained(path)


# The tests name their runs without `launches` marks: each DeepSpeed run gets a launch of its own, on demand (a
# marked batch would run two Trainers in one process that initialised DeepSpeed, which no user does).
MODEL_ARGS = ("--model_name_or_path", "{in}", "--tokenizer_name_or_path", TOKENIZER)
RECIPE_ARGS = (*MODEL_ARGS, *FIXED_LENGTH, *SGD)
register(**{
    "deepspeed/reference": recipe_run(None, "--per_device_train_batch_size", "4", *RECIPE_ARGS, setup=save_tiny_fp32),
    **{f"deepspeed/zero{stage}": recipe_run(str(CONFIGS / f"cpu_deepspeed_zero{stage}.yaml"), "--per_device_train_batch_size",
                                            "2", *RECIPE_ARGS, env=DS_ENV, setup=save_tiny_fp32)
       for stage in (2, 3)},
    # Gradient accumulation: 2 micro-batches of 1 row per rank and step, the same 4 rows per step as the reference.
    "deepspeed/zero2-ga2": recipe_run(str(CONFIGS / "cpu_deepspeed_zero2_ga2.yaml"), "--per_device_train_batch_size", "1",
                                      "--gradient_accumulation_steps", "2", *RECIPE_ARGS, env=DS_ENV, setup=save_tiny_fp32),
    # A reward model (AutoModelForSequenceClassification) with the plain Trainer: tests/test_reward_models.py's script.
    "deepspeed/reward-zero3": Run(str(CONFIGS / "cpu_deepspeed_zero3.yaml"), REWARD_SCRIPT, ("{in}", "{out}", "2"), env=DS_ENV,
                                  setup=save_tiny_reward_model),
    # Qwen3.5-MoE with the router's loss on: dp 2's oracle is one process over the same two micro-batches
    # (tests/test_moe_launch.py's moe/reference-ga2).
    "deepspeed/moe-zero3": recipe_run(str(CONFIGS / "cpu_deepspeed_zero3.yaml"), "--per_device_train_batch_size", "2", *MOE,
                                      env=DS_ENV, setup=save_tiny_moe),
    # AdamW (the recipe's optimizer): its state is what a resume must bring back. Checkpoint at step 2 of 4.
    "deepspeed/zero3-resume-full": recipe_run(str(CONFIGS / "cpu_deepspeed_zero3.yaml"), "--per_device_train_batch_size", "2",
                                              *MODEL_ARGS, *FIXED_LENGTH, *RESUME_FROM, env=DS_ENV, setup=save_tiny_fp32),
    "deepspeed/zero3-resume-resumed": recipe_run(
        str(CONFIGS / "cpu_deepspeed_zero3.yaml"), "--per_device_train_batch_size", "2", *MODEL_ARGS, *FIXED_LENGTH,
        "--resume_from_checkpoint", "{out:deepspeed/zero3-resume-full}/checkpoint-2", env=DS_ENV, setup=save_tiny_fp32,
        after=("deepspeed/zero3-resume-full",)),
    # The unchanged recipe under the ZeRO-3 bf16 YAML from a checkpoint as shipped, loaded bf16 (`--dtype bfloat16`, as
    # Transformers loads Qwen's checkpoints by default). `--bf16` is the Trainer's own switch for the YAML's bf16 (the
    # YAML alone: "ds bf16.enabled=True vs hf bf16=False"); `--use_cpu` is what Transformers asks for bf16 on a
    # machine without a GPU (DeepSpeed stays the engine: the launcher's environment chooses it). AdamW at lr 1e-5:
    # steps bf16 would round away.
    "deepspeed/trainer-zero3-bf16": recipe_run(
        str(CONFIGS / "cpu_deepspeed_zero3_bf16.yaml"), "--per_device_train_batch_size", "2", *MODEL_ARGS, *FIXED_LENGTH,
        "--dtype", "bfloat16", "--bf16", "--use_cpu", "--learning_rate", "1e-5", env=DS_ENV, setup=save_as_shipped),
    **{f"deepspeed/zero{stage}-bf16": Run(str(CONFIGS / f"cpu_deepspeed_zero{stage}_bf16.yaml"), LOOP, ("{in}", "{out}"),
                                          env=DS_ENV, setup=save_as_shipped)
       for stage in (2, 3)},
})


def _named(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Transformers' save_pretrained of ZeRO-3's consolidated state dict writes the checkpoint format's
    # names (`model.language_model.…`); the load maps them back (checked below).
    return {k.replace("model.language_model.", "model."): v for k, v in weights.items()}


@pytest.mark.parametrize("stage,run,reference", [
    (2, "deepspeed/zero2", "deepspeed/reference"),
    (3, "deepspeed/zero3", "deepspeed/reference"),
    (2, "deepspeed/zero2-ga2", "deepspeed/reference"),
    (3, "deepspeed/moe-zero3", "moe/reference-ga2"),
], ids=["zero2", "zero3", "zero2-ga2", "moe-zero3"])
def test_fp32_zero_under_the_trainer_equals_one_process(launched, stage, run, reference):
    """The unchanged recipe under ZeRO-2 (also accumulating 2 micro-batches per step: the gates' gradients
    summed over them and reduced once), and ZeRO-3 with zero.Init (the Trainer's load partitions the
    gates), dense and MoE (the router's loss counted as one process counts it): every logged value per
    step (loss, grad_norm with gradient_clipping 1.0, …) and every saved weight, the gates fp32 in the
    file, as one process on the same rows (fp32: rtol 1e-5; ZeRO reduces in another order). The saved
    checkpoint loads in one process with those values."""
    from transformers import AutoModelForCausalLM

    actual, expected = launched(run), launched(reference)
    assert f"prepared by qwen35_accel for DeepSpeed ZeRO-{stage}" in actual.stderr
    assert_same_log_history(actual.out, expected.out, rtol=1e-5, flos=True)
    a, b = _named(load_file(actual.out / "model.safetensors")), load_file(expected.out / "model.safetensors")
    assert set(a) == set(b)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    assert {a[k].dtype for k in a if k.endswith(GATES)} == {torch.float32}
    reloaded = dict(AutoModelForCausalLM.from_pretrained(actual.out).named_parameters())
    assert {k for k in a if k.endswith(GATES)} <= set(reloaded)
    for key in set(a) & set(reloaded):  # (the MoE's experts load fused: other names)
        assert torch.equal(reloaded[key].detach(), a[key]), key


def test_a_reward_model_under_zero3_trains_as_one_process(launched):
    """A Qwen3.5 reward model (sequence classification, num_labels 1) through the plain Trainer under ZeRO-3 with
    zero.Init, dp 2 x batch 2: every logged value (loss, grad norm, the evaluation's loss), every saved weight
    (the score head's and the gates, fp32) and `predict`'s scores as one process on batch 4 (fp32 rtol 1e-5;
    SGD; tests/test_reward_models.py's reference run)."""
    run, reference = launched("deepspeed/reward-zero3"), launched("reward/reference")
    assert REWARD_PREPARED + " for DeepSpeed ZeRO-3" in run.stderr
    assert_same_training(run.out, reference.out, rtol=1e-5)
    saved = _named(load_file(run.out / "model.safetensors"))
    assert {saved[k].dtype for k in saved if k.endswith(GATES)} == {torch.float32}
    got, want = (torch.load(r.out / "predictions.pt") for r in (run, reference))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_zero3_checkpoint_resumes_the_gates_optimizer_and_consolidates_the_gates(launched):
    """The Trainer's periodic DeepSpeed checkpoint under ZeRO-3 (zero.Init) with AdamW: it carries the gates'
    fp32 values and their AdamW state (DeepSpeed's engine knows only its own parameters), a run resumed from
    it repeats the uninterrupted run's steps 3-4 and final weights (same layout on both sides: fp32 rtol
    1e-5; a fresh gate AdamW moves each gate by ~lr = 3e-3 at step 3), and DeepSpeed's `zero_to_fp32`
    writes every weight of the checkpoint's model file, the gates fp32 among them."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    full = launched("deepspeed/zero3-resume-full").out
    resumed = launched("deepspeed/zero3-resume-resumed").out
    states = torch.load(full / "checkpoint-2" / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    gate_optimizer = states["qwen35_accel_gates"]["optimizer"]
    assert {"exp_avg", "exp_avg_sq"} <= set(next(iter(gate_optimizer["state"].values())))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(losses(resumed, key)[-2:]), torch.tensor(losses(full, key)[-2:]),
                                   rtol=1e-5, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    a, b = load_file(resumed / "model.safetensors"), load_file(full / "model.safetensors")
    assert set(a) == set(b) and any(k.endswith(GATES) for k in b)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    consolidated = get_fp32_state_dict_from_zero_checkpoint(full / "checkpoint-2")
    saved = _named(load_file(full / "checkpoint-2" / "model.safetensors"))
    assert set(consolidated) == set(saved)
    for key in saved:
        assert consolidated[key].dtype == torch.float32 and torch.equal(consolidated[key], saved[key]), key


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_zero_trains_the_gates_in_fp32_from_a_checkpoint_as_shipped(launched, stage):
    """bf16 under ZeRO-2, and ZeRO-3 with zero.Init: every training forward reads the gates in fp32, the
    first bitwise the checkpoint's fp32 values (the bf16 load rounded them; they are read back); they
    train (fp32 steps of ~1e-5 that bf16 would round away) and are saved fp32; a bf16 load of the saved
    checkpoint in one process gets those fp32 values back where the plugin holds the gates (its fp32
    holders read them from the file, as at any prepare). A reference model TRL hands to DeepSpeed itself
    (`prepare_deepspeed`: a stage-0 engine under ZeRO-2, ZeRO-3 under ZeRO-3) reads the checkpoint's fp32 gates
    too (stock: bf16)."""
    from transformers import AutoModelForCausalLM

    from qwen35_accel import install_fp32_gate

    run = launched(f"deepspeed/zero{stage}-bf16")
    assert "were loaded below fp32; their fp32 values were read back, bitwise" in run.stderr
    assert f"prepared by qwen35_accel for DeepSpeed ZeRO-{stage}" in run.stderr
    engine_stage = 3 if stage == 3 else 0  # TRL's inference engine: stage 0 below ZeRO-3
    assert (f"(DPOTrainer's reference or reward model, TRL's prepare_deepspeed) prepared by qwen35_accel for DeepSpeed's "
            f"inference engine (ZeRO-{engine_stage}): 2 GatedDeltaNet gate holders (A_log/dt_bias) in fp32") in run.stderr
    shipped = load_file(run.inputs / "model.safetensors")
    first = "model.layers.0.linear_attn."
    record = torch.load(run.out / "run.pt")
    assert len(record["seen"]) == 4 and all(dtype == "torch.float32" for step in record["seen"] for dtype, _ in step.values())
    for name in GATES:
        assert torch.equal(record["seen"][0][name][1], shipped[first + name]), name
        # TRL's own DeepSpeed preparation of a reference model (DPOTrainer's prepare_deepspeed): fp32, the checkpoint's
        assert record["reference"][name][0] == "torch.float32", record["reference"][name][0]
        assert torch.equal(record["reference"][name][1], shipped[first + name]), name
    assert all(torch.isfinite(torch.tensor(record["losses"]))) and record["norms"][0] > 0
    saved = _named(load_file(run.out / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(run.out, dtype=torch.bfloat16)
    assert install_fp32_gate(model) == 2
    reloaded = dict(model.named_parameters())
    for key in (k for k in shipped if k.endswith(GATES)):
        assert saved[key].dtype == torch.float32 and not torch.equal(saved[key], shipped[key]), key  # trained
        assert reloaded[key].dtype == torch.float32 and torch.equal(reloaded[key].detach(), saved[key]), key


def test_unchanged_trainer_under_a_zero3_bf16_yaml_trains_the_gates_in_fp32_from_a_checkpoint_as_shipped(launched):
    """The recipe, unchanged, under the ZeRO-3 bf16 YAML (zero.Init) from a checkpoint as Qwen ships it, loaded
    bf16: the engine runs bf16 (every other weight saved bf16) while the gates were read back to the
    checkpoint's fp32 values, trained by fp32 AdamW steps of ~1e-5 and saved fp32. Every gate value moved from
    the checkpoint, each by at most its four steps (lr 1e-5 each: 1e-4 with room for Adam's bias correction), far below
    the bf16 rounding of those values, which a bf16 load or bf16 training would have left in the file (stock:
    bf16 gates)."""
    run = launched("deepspeed/trainer-zero3-bf16")
    assert "were loaded below fp32; their fp32 values were read back, bitwise" in run.stderr
    assert "prepared by qwen35_accel for DeepSpeed ZeRO-3: 2 GatedDeltaNet gate holders (A_log/dt_bias) in fp32" in run.stderr
    history = losses(run.out)
    assert len(history) == 4 and all(torch.isfinite(torch.tensor(history))), history
    shipped = load_file(run.inputs / "model.safetensors")
    saved = _named(load_file(run.out / "model.safetensors"))
    assert set(saved) == set(shipped)
    assert {saved[k].dtype for k in saved if not k.endswith(GATES)} == {torch.bfloat16}
    for key in (k for k in shipped if k.endswith(GATES)):
        rounding = (shipped[key] - shipped[key].bfloat16().float()).abs().max().item()
        moved = (saved[key] - shipped[key]).abs()
        assert saved[key].dtype == torch.float32 and 0 < moved.min() and moved.max() <= 1e-4 < rounding, (key, moved, rounding)


SP2 = "parallelism_config:\n  parallelism_config_sp_size: 2\n  parallelism_config_sp_backend: deepspeed\n"


@pytest.mark.parametrize("change,refusal", [
    (("mixed_precision: 'bf16'", "mixed_precision: 'fp16'"), "fp16 under DeepSpeed"),
    (("mixed_precision: 'bf16'", "mixed_precision: 'no'\n" + SP2), "DeepSpeed's sequence parallelism (Ulysses/ALST, sp_size 2)"),
], ids=["fp16", "ulysses-sp2"])
def test_what_cannot_be_exact_under_deepspeed_is_refused_on_every_rank_with_the_reason(tmp_path, change, refusal):
    """Refused at prepare on every rank, with the reason: fp16 (its dynamic loss scale skips overflowing steps
    the gates' optimizer would not know of; names bf16), and DeepSpeed's sequence parallelism (each
    GatedDeltaNet would restart its state on every rank; names the FSDP2 path's context parallelism —
    Accelerate's own refusal offers `sp_allow_recurrent_layers`, which would train on wrong gradients)."""
    config = tmp_path / "refused.yaml"
    config.write_text((CONFIGS / "cpu_deepspeed_zero2_bf16.yaml").read_text().replace(*change))
    save_as_shipped(tmp_path / "model")
    result = run_launch(accelerate_launch_command(config, LOOP, str(tmp_path / "model"), str(tmp_path / "out")), env=DS_ENV)
    assert_refused_on_every_rank(result, "NotImplementedError", f"Qwen3_5ForCausalLM under DeepSpeed: {refusal}")


def test_trainer_deepspeed_argument_under_torchrun_equals_one_process(launched, tmp_path):
    """`TrainingArguments(deepspeed={...ZeRO-2...})` launched by torchrun (no Accelerate config): the plugin
    prepares it as under `accelerate launch`, and every logged value and every saved weight equal one
    process on the global batch (tests/test_torchrun_launch.py's reference), total_flos included (the
    plugin counts the gates `num_parameters()` no longer sees)."""
    single = launched("torchrun/single").out / "single"
    result = run_launch(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(TORCHRUN_SCRIPT), str(tmp_path), "--deepspeed"], env=DS_ENV,
    )
    assert result.returncode == 0 and not result.leftover_processes, describe(result)
    assert "prepared by qwen35_accel for DeepSpeed ZeRO-2" in result.stderr
    assert_same_training(tmp_path / "zero2", single, rtol=1e-5, flos=True)
