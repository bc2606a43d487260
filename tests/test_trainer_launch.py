"""Trainer level: `accelerate launch --config_file accelerate_configs/… recipes/sft.py`,
unchanged script, against one process without Accelerate launch.

Each run is a real launch (the plugin activates itself through the torch entry point); the
runs of one config share one launch, the recipe's `main` run one after the other with a fresh
Trainer and Accelerator each (tests/_launched.py). Per-step losses come from the Trainer's own
`trainer_state.json`, final weights from the saved Hugging Face checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _launched import Run, register
from _parity import assert_same_log_history
from safetensors.torch import load_file

from qwen35_accel.testing.launch import RECIPE

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch: each test launches worlds

PREPARED = "prepared by qwen35_accel"
COMMON = ["--max_steps", "4", "--logging_steps", "1", "--seed", "0"]
# Every comparison also checks the logged grad_norm per step: a wrong loss scaling under
# dp/cp shows there first. Weights are compared after plain SGD: AdamW's update
# lr * m / (sqrt(v) + eps) turns reduction-order noise in a near-zero gradient (heads
# whose state decays within one token, A = exp(A_log) ~ 15 in the tiny init, get
# |dL/dA_log| ~ 1e-10) into a step of order lr whose sign the rounding decides; under SGD
# a weight differs from the reference exactly as much as its summed gradients did.
SGD = ["--optim", "sgd", "--learning_rate", "0.3"]
# Every batch 62 positions long (the longest example has 57 tokens) on every rank: the ranks'
# batch shapes add up to one process's, so the Trainer's total_flos (it counts positions,
# padding included) compares exactly; 62 is not a multiple of 2·cp, so under cp the Trainer
# patch point still pads the collator's BatchEncoding.
FIXED_LENGTH = ["--pad_to_multiple_of", "62"]


def recipe_run(config: str | None, *args: str, **kwargs) -> Run:
    """recipes/sft.py with COMMON and `args`, output in the run's `{out}` (tests/_launched.py)."""
    return Run(config, RECIPE, (*COMMON, "--output_dir", "{out}", *args), **kwargs)


SHARDED = {"FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}  # what the config's fsdp_state_dict_type sets
RESUME_FROM = ("--save_strategy", "steps", "--save_steps", "2")


def save_tiny_llama(path: Path) -> None:
    """A tiny random Llama (the recipe's byte-level tokenizer fits it): a model the plugin leaves alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, eos_token_id=256, pad_token_id=256)
    ).save_pretrained(path)


# One launch per config for the whole module (and the other modules' runs of that config).
register(**{
    # One process, no launcher: per-device batch 4 = the global batch of every launch below.
    "trainer/reference_sgd": recipe_run(None, "--per_device_train_batch_size", "4", *FIXED_LENGTH, *SGD),
    **{f"trainer/fsdp2-{kind}": recipe_run("cpu_fsdp2.yaml", "--per_device_train_batch_size", "2", *FIXED_LENGTH, *SGD,
                                           env=SHARDED if kind == "SHARDED_STATE_DICT" else {})
       for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")},
    "trainer/cp2": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *FIXED_LENGTH, *SGD),
    # Accelerate's dynamo_config (what the YAML's `dynamo_backend` sets), AOT_EAGER: the traced graphs
    # without inductor's code generation (minutes on 2 cores); fixed-length batches compile once.
    "trainer/fsdp2-compiled": recipe_run("cpu_fsdp2.yaml", "--per_device_train_batch_size", "2", *FIXED_LENGTH, *SGD,
                                         env={"ACCELERATE_DYNAMO_BACKEND": "AOT_EAGER"}),
    "trainer/cp2-compiled": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *FIXED_LENGTH, *SGD,
                                       env={"ACCELERATE_DYNAMO_BACKEND": "AOT_EAGER"}),
    # Activation offload, each switch a user has: Accelerate's (the config's fsdp_activation_checkpointing[_offload],
    # here through the FSDP plugin's environment) and Transformers' (the Trainer's checkpointing kwargs).
    "trainer/cp2-offload-accelerate": recipe_run(
        "cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *FIXED_LENGTH, *SGD,
        env={"FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"}),
    "trainer/cp2-offload-transformers": recipe_run(
        "cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *FIXED_LENGTH, *SGD, "--activation_checkpointing",
        "--activation_checkpointing_kwargs", '{"offload": true}'),
    "trainer/dp2xcp2": recipe_run("cpu_fsdp2_dp2_cp2.yaml", "--per_device_train_batch_size", "2", *FIXED_LENGTH, *SGD),
    "trainer/dp2xtp2": recipe_run("cpu_fsdp2_tp2.yaml", "--per_device_train_batch_size", "2", *FIXED_LENGTH, *SGD),
    **{f"trainer/packed-{name}-{form}": recipe_run(config, "--per_device_train_batch_size", per_device, "--packing", *flags, *SGD)
       for name, config, per_device in (("fsdp2", "cpu_fsdp2.yaml", "2"), ("cp2", "cpu_fsdp2_cp2.yaml", "4"))
       for form, flags in (("position_ids", ()), ("cu_seq_lens", ("--packing_flash_attn_kwargs",)))},
    "trainer/resume-full": recipe_run("cpu_fsdp2.yaml", "--per_device_train_batch_size", "2", *RESUME_FROM),
    "trainer/resume-resumed": recipe_run("cpu_fsdp2.yaml", "--per_device_train_batch_size", "2", "--resume_from_checkpoint",
                                         "{out:trainer/resume-full}/checkpoint-2", after=("trainer/resume-full",)),
    "trainer/llama": recipe_run("cpu_fsdp2.yaml", "--model_name_or_path", "{in}", "--tokenizer_name_or_path",
                                str(RECIPE.parent / "configs" / "tokenizer"), "--per_device_train_batch_size", "2",
                                setup=save_tiny_llama),
})
for _kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
    _env = SHARDED if _kind == "SHARDED_STATE_DICT" else {}
    register(**{f"trainer/tp-resume-{_kind}-full": recipe_run("cpu_fsdp2_tp2.yaml", "--per_device_train_batch_size", "2",
                                                               *RESUME_FROM, env=_env)})
    register(**{f"trainer/tp-resume-{_kind}-resumed": recipe_run(
        "cpu_fsdp2_tp2.yaml", "--per_device_train_batch_size", "2",
        "--resume_from_checkpoint", f"{{out:trainer/tp-resume-{_kind}-full}}/checkpoint-2", env=_env,
        after=(f"trainer/tp-resume-{_kind}-full",))})


def losses(out: Path, key: str = "loss") -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry[key] for entry in history if "loss" in entry]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def assert_same_training(actual: Path, expected: Path, rtol: float, weight_atol: float = 1e-6, flos: bool = False) -> None:
    assert len(losses(expected)) == 4 and losses(expected)[-1] < losses(expected)[0]
    # Every value the Trainer logged (loss, grad_norm, learning_rate, epoch, train_loss) per
    # step; with `flos`, total_flos (Transformers sums the ranks' counts in float32: exact for
    # the tiny model's).
    assert_same_log_history(actual, expected, rtol=rtol, flos=flos)
    a, b = weights(actual), weights(expected)
    assert set(a) == set(b)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=weight_atol, msg=lambda m, key=key: f"{key}: {m}")
    assert a["model.layers.0.linear_attn.A_log"].dtype == torch.float32


def runs(*names: str):
    return pytest.mark.launches(*names)


REFERENCE = "trainer/reference_sgd"


@pytest.mark.parametrize(
    "state_dict_type",
    [pytest.param(kind, marks=runs(REFERENCE, f"trainer/fsdp2-{kind}")) for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")],
)
def test_fsdp2_on_two_cpu_processes_matches_one_process_and_saves_a_loadable_checkpoint(launched, state_dict_type):
    """cpu_fsdp2.yaml, its fsdp_state_dict_type set to the one under test (the FSDP plugin's
    FSDP_STATE_DICT_TYPE, what the config's key sets)."""
    from transformers import AutoModelForCausalLM

    run, reference_sgd = launched(f"trainer/fsdp2-{state_dict_type}"), launched(REFERENCE).out
    out = run.out
    assert PREPARED in run.stderr and "FSDP2 runs on CPU over gloo" in run.stderr
    # fp32 rtol 1e-5: FSDP2 sums the two ranks' gradients in another order than one process.
    assert_same_training(out, reference_sgd, rtol=1e-5, flos=True)

    model = AutoModelForCausalLM.from_pretrained(out)
    expected = AutoModelForCausalLM.from_pretrained(reference_sgd)
    assert model.model.layers[0].linear_attn.A_log.dtype == torch.float32
    ids = torch.arange(1, 33).reshape(2, 16)
    # The weights matched at rtol 1e-5 / atol 1e-6 above; logits of 16 tokens through 3 layers: atol 1e-5.
    torch.testing.assert_close(model(input_ids=ids).logits, expected(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name,shows",
    [pytest.param(name, shows, marks=runs(REFERENCE, f"trainer/{name}"), id=name)
     for name, shows in (("cp2", "cp=2"), ("dp2xcp2", "cp=2"), ("dp2xtp2", "tp=2"),
                         ("cp2-offload-accelerate", "in host memory (Accelerate's fsdp_activation_checkpointing_offload)"),
                         ("cp2-offload-transformers", "in host memory (Transformers' offload)"))],
)
def test_context_and_tensor_parallel_launches_match_one_process(launched, name, shows):
    """Losses, grad norms, weights, and total_flos: the ranks of a cp or tp group hold one
    batch, which the Trainer must count once, with the whole model's parameters."""
    from transformers import AutoModelForCausalLM

    run = launched(f"trainer/{name}")
    assert PREPARED in run.stderr and shows in run.stderr
    # rtol 1e-4: under CP every gradient is a sum of per-chunk partials reduced over cp (and dp),
    # and 4 SGD steps at lr 0.3 carry those reduction-order differences into the later losses.
    assert_same_training(run.out, launched(REFERENCE).out, rtol=1e-4, flos=True)
    assert AutoModelForCausalLM.from_pretrained(run.out).model.layers[0].linear_attn.A_log.dtype == torch.float32


@pytest.mark.parametrize(
    "config,form,rtol",
    # fp32 rtol 1e-5: FSDP2's reduction order, and each document's kernels batched with others;
    # rtol 1e-4 under CP: as for the CP launches above (per-chunk partials over 4 SGD steps).
    [pytest.param(config, form, rtol, marks=runs(REFERENCE, f"trainer/packed-{config}-{form}"), id=f"{form}-{config}")
     for config, rtol in (("fsdp2", 1e-5), ("cp2", 1e-4)) for form in ("position_ids", "cu_seq_lens")],
)
def test_packed_rows_through_a_launch_train_exactly_as_padded_rows_in_one_process(launched, config, form, rtol):
    """DataCollatorWithFlattening (one row per rank, documents restarting their positions)
    under FSDP2 on 2 processes, and under cp 2 (the row, of any length, padded to 2·cp by
    the Trainer patch point and split across the ranks), against the padded single-process
    run: packing computes every example on its own, so nothing but the layout may differ."""
    run = launched(f"trainer/packed-{config}-{form}")
    assert PREPARED in run.stderr
    assert_same_training(run.out, launched(REFERENCE).out, rtol=rtol)


@runs("trainer/resume-full", "trainer/resume-resumed")
@pytest.mark.parametrize("layout,regions", [
    ("fsdp2", "attention, GatedDeltaNet projections and gated output, GatedDeltaNet conv and gated delta rule (torch functions)"),
    ("cp2", "attention projections and output, GatedDeltaNet projections and gated output, GatedDeltaNet chunk summaries "
            "and reads (torch functions)"),
])
@pytest.mark.launches("trainer/fsdp2-FULL_STATE_DICT", "trainer/fsdp2-compiled", "trainer/cp2", "trainer/cp2-compiled")
def test_accelerates_dynamo_config_compiles_the_prepared_model_and_trains_as_eager(launched, layout, regions):
    """cpu_fsdp2.yaml with Accelerate's dynamo_config: the first compiled forward crashed on every rank
    (`Expected CellVariable ... in load_cell`: dynamo traced the layer's kernel choice); now the
    plugin's units train the compiled model as eager, compiled per decoder layer between the FSDP2 unit
    boundaries (test_compile: no graph break), and the prepared line says what is compiled. Under
    cpu_fsdp2_cp2.yaml too (the rule's local steps compiled around CP's state exchange)."""
    compiled = launched(f"trainer/{layout}-compiled")
    assert "Qwen3_5ForCausalLM prepared by qwen35_accel" in compiled.stderr, compiled.stderr[-3000:]
    assert f"torch.compile (Accelerate's dynamo_config): per decoder layer, norms, MLP, {regions};" in compiled.stderr, \
        compiled.stderr[-3000:]
    # fp32 rtol 1e-5: aot_eager runs the traced ATen ops (a decomposition may sum in another order).
    eager = launched("trainer/fsdp2-FULL_STATE_DICT" if layout == "fsdp2" else "trainer/cp2")
    assert_same_training(compiled.out, eager.out, rtol=1e-5)


def test_resume_from_checkpoint_continues_with_the_uninterrupted_losses(launched):
    full = launched("trainer/resume-full").out
    assert (full / "checkpoint-2").is_dir()
    resumed = launched("trainer/resume-resumed").out
    # Same layout on both sides; only the checkpoint round trip differs: fp32 rtol 1e-5.
    torch.testing.assert_close(torch.tensor(losses(resumed)[-2:]), torch.tensor(losses(full)[-2:]), rtol=1e-5, atol=0)


@runs("trainer/llama")
def test_other_models_keep_accelerates_own_fsdp2_path_through_the_same_launch(launched):
    """A Llama run in the launch of the module's Qwen3.5 runs: the plugin leaves it to stock Accelerate."""
    run = launched("trainer/llama")
    assert PREPARED not in run.stderr and "FSDP2 runs on CPU over gloo" in run.stderr
    history = losses(run.out)
    assert history[-1] < history[0]


@pytest.mark.parametrize(
    "state_dict_type",
    [pytest.param(kind, marks=runs(f"trainer/tp-resume-{kind}-full", f"trainer/tp-resume-{kind}-resumed"))
     for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")],
)
def test_resuming_a_tensor_parallel_run_continues_with_the_uninterrupted_training(launched, state_dict_type):
    """dp 2 x tp 2: the Trainer's periodic checkpoint (model + AdamW state, Transformers
    layout) resumes into the per-head slices; steps 3-4 and the final weights repeat."""
    full = launched(f"trainer/tp-resume-{state_dict_type}-full").out
    resumed = launched(f"trainer/tp-resume-{state_dict_type}-resumed").out
    # The checkpoint in the layout under test (the run's FSDP_STATE_DICT_TYPE reached the FSDP plugin).
    model_file = "pytorch_model_fsdp_0" if state_dict_type == "SHARDED_STATE_DICT" else "pytorch_model_fsdp.bin"
    assert (full / "checkpoint-2" / model_file).exists(), sorted(p.name for p in (full / "checkpoint-2").iterdir())
    # Same dp x tp layout and AdamW on both sides (one reduction order); only the checkpoint
    # round trip (gather to Transformers' layout, slice on load) differs: fp32 rtol 1e-5.
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(losses(resumed, key)[-2:]), torch.tensor(losses(full, key)[-2:]),
                                   rtol=1e-5, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    a, b = weights(resumed), weights(full)
    assert set(a) == set(b)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
