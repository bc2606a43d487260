"""Qwen3.5-MoE through the Trainer: `accelerate launch --config_file accelerate_configs/cpu_fsdp2.yaml
recipes/sft.py`, unchanged, against one process without a launcher (issue 46, slice 2).

Before: Accelerate's own FSDP2 path ran (no fp32 gate units; with a bf16 load the gates trained
bf16-rounded) and, before Accelerate 1.16, stopped at its wrap policy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launched import register
from test_trainer_launch import FIXED_LENGTH, PREPARED, RESUME_FROM, SGD, assert_same_training, losses, recipe_run, runs

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOKENIZER = str(Path(__file__).parent.parent / "recipes" / "configs" / "tokenizer")


# The router's load-balancing loss on in every launch, at a coefficient large enough to see: 0.05 x
# ~2.1 (the tiny model's router loss) is ~0.1 of a ~5.7 loss, and the per-rank and whole-batch
# router losses differ by ~5e-3 (2.3e-4 of the loss, 4e-5 relative: above rtol 1e-5). A router term
# counted twice (stock Trainer at world 2, issue 57) is 0.1 off.
ROUTER_LOSS = {"output_router_logits": True, "router_aux_loss_coef": 0.05}


def save_tiny_moe(path: Path) -> None:
    """`build_tiny_moe_causal_lm` (routers that discriminate, weak decay) at the recipe's
    byte-level vocabulary, the router's loss on (`ROUTER_LOSS`)."""
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

    build_tiny_moe_causal_lm(seed=0, vocab_size=264, eos_token_id=256, pad_token_id=256, **ROUTER_LOSS).save_pretrained(path)


def save_tiny_moe8(path: Path) -> None:
    """`save_tiny_moe` with 8 experts: ep 2 x tp 2 holds 2 per rank."""
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm

    build_tiny_moe_causal_lm(seed=0, vocab_size=264, eos_token_id=256, pad_token_id=256, num_experts=8,
                             **ROUTER_LOSS).save_pretrained(path)


EP2 = {"QWEN35_ACCEL_EP": "2"}
GLOBAL = {"QWEN35_ACCEL_MOE_BALANCE": "global"}
GA2 = ("--gradient_accumulation_steps", "2")
# SGD with momentum: linear in the gradients, as plain SGD (see test_trainer_launch), and with an
# optimizer state for the checkpoints to carry (torch's full-state-dict load of a stateless
# optimizer raises "Expected device to be set").
MOE = ("--model_name_or_path", "{in}", "--tokenizer_name_or_path", TOKENIZER, *FIXED_LENGTH, *SGD, "--optim_args", "momentum=0.9")
# The oracles (docs/moe.md, "The router's loss in a step"): the step's loss is the cross entropy over
# the global batch plus coef x the mean of the step's router losses, one per data-parallel replica
# and micro-batch (one per micro-batch of the global batch with the global balance).
# - moe/reference, one process on the 4 rows: the oracle of every layout with one data-parallel
#   replica (cp 2, ep x cp) and of the global balance without accumulation;
# - moe/reference-ga2, one process with 2 micro-batches of 2 rows, the same rows as dp 2's ranks
#   (Accelerate gives rank r the r-th batch of 2): the oracle of dp 2 (each rank's router loss) and of
#   dp 2 x accumulation 2 with the global balance. Under the plugin its router term is coef x the
#   micro-batches' mean, which stock computes with coef / 2 (tests/test_router_loss.py).
register(**{
    "moe/reference": recipe_run(None, "--per_device_train_batch_size", "4", *MOE, setup=save_tiny_moe),
    "moe/reference-ga2": recipe_run(None, "--per_device_train_batch_size", "2", *GA2, *MOE, setup=save_tiny_moe),
    "moe/fsdp2": recipe_run("cpu_fsdp2.yaml", "--per_device_train_batch_size", "2", *MOE, setup=save_tiny_moe),
    # The issue-57 table: ep 2 over dp 2 with the global balance; dp 2 x accumulation 2 (global).
    "moe/ep2-global": recipe_run("cpu_fsdp2.yaml", "--per_device_train_batch_size", "2", *MOE, setup=save_tiny_moe,
                                 env={**EP2, **GLOBAL}),
    "moe/fsdp2-ga2-global": recipe_run("cpu_fsdp2.yaml", "--per_device_train_batch_size", "1", *GA2, *MOE,
                                       setup=save_tiny_moe, env=GLOBAL),
    # dp 2 x cp 2 (world 4), ep 2, the global balance: three more router terms in stock.
    "moe/dp2-cp2-ep2-global": recipe_run("cpu_fsdp2_dp2_cp2.yaml", "--per_device_train_batch_size", "2", *MOE,
                                         setup=save_tiny_moe, env={**EP2, **GLOBAL}),
    "moe/cp2": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *MOE, *RESUME_FROM,
                          setup=save_tiny_moe),
    # Expert parallelism from the knob, the YAML unchanged: ep 2 over cp 2's two ranks (ep x cp at world 2).
    "moe/ep2-cp2": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *MOE, *RESUME_FROM,
                              setup=save_tiny_moe, env=EP2),
    # dp 2 x tp 2 (world 4): head-parallel mixers, the shared expert split as an MLP, the routed experts whole over tp.
    "moe/dp2xtp2": recipe_run("cpu_fsdp2_tp2.yaml", "--per_device_train_batch_size", "2", *MOE, setup=save_tiny_moe),
    # ep 2 x tp 2 (world 4): each tp rank's 4 experts split over the 2 dp ranks, outside FSDP2.
    "moe8/reference-ga2": recipe_run(None, "--per_device_train_batch_size", "2", *GA2, *MOE, setup=save_tiny_moe8),
    "moe8/ep2xtp2": recipe_run("cpu_fsdp2_tp2.yaml", "--per_device_train_batch_size", "2", *MOE, *RESUME_FROM,
                               setup=save_tiny_moe8, env=EP2),
    "moe8/tp2-from-ep2xtp2": recipe_run("cpu_fsdp2_tp2.yaml", "--per_device_train_batch_size", "2", *MOE,
                                        "--resume_from_checkpoint", "{out:moe8/ep2xtp2}/checkpoint-2", setup=save_tiny_moe8,
                                        after=("moe8/ep2xtp2",)),
    # Each one's step-2 checkpoint resumed in the other layout.
    "moe/cp2-from-ep2": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *MOE,
                                   "--resume_from_checkpoint", "{out:moe/ep2-cp2}/checkpoint-2", setup=save_tiny_moe,
                                   after=("moe/ep2-cp2",)),
    "moe/ep2-from-cp2": recipe_run("cpu_fsdp2_cp2.yaml", "--per_device_train_batch_size", "4", *MOE,
                                   "--resume_from_checkpoint", "{out:moe/cp2}/checkpoint-2", setup=save_tiny_moe,
                                   env=EP2, after=("moe/cp2",)),
})


@runs("moe/reference-ga2", "moe/fsdp2")
def test_a_qwen35_moe_model_under_fsdp2_gets_fp32_gate_units_and_trains_as_one_process(launched):
    """dp 2, each rank's router loss (the default balance): one process's 2 micro-batches of the same
    rows (before: the router term counted twice, 0.1 off the loss)."""
    run, reference = launched("moe/fsdp2"), launched("moe/reference-ga2")
    lines = [line for line in run.stderr.splitlines() if PREPARED in line]
    assert len(lines) == 1 and "] Qwen3_5MoeForCausalLM prepared by qwen35_accel: dtype-uniform FSDP2 units" in lines[0], run.stderr
    assert "fp32 gate holders" in lines[0] and "loss: tiled, recompute" in lines[0]
    # fp32 rtol 1e-5: FSDP2 sums the two ranks' gradients in another order than one process;
    # every logged value, the saved weights and the fp32 gates (assert_same_training).
    assert_same_training(run.out, reference.out, rtol=1e-5)
    from safetensors.torch import load_file

    saved = load_file(run.out / "model.safetensors")
    # Every expert saved whole (gathered from the shards), in the checkpoint's per-expert names.
    assert {key.split(".")[5] for key in saved if key.startswith("model.layers.0.mlp.experts.")} == set("012345")
    assert saved["model.layers.0.linear_attn.dt_bias"].dtype == torch.float32


@runs("moe/reference", "moe/cp2")
def test_a_qwen35_moe_model_under_cp2_trains_as_one_process(launched):
    """cpu_fsdp2_cp2.yaml: both ranks hold the same 4 rows, each its chunks of every row (before:
    Accelerate refused CP for the model)."""
    run, reference = launched("moe/cp2"), launched("moe/reference")
    lines = [line for line in run.stderr.splitlines() if PREPARED in line]
    assert len(lines) == 1 and "Qwen3_5MoeForCausalLM prepared by qwen35_accel" in lines[0] and "cp=2" in lines[0], run.stderr
    assert_same_training(run.out, reference.out, rtol=1e-5)


@runs("moe/reference", "moe/ep2-cp2")
def test_a_qwen35_moe_model_under_ep2_and_cp2_trains_as_one_process_and_saves_every_expert(launched):
    """QWEN35_ACCEL_EP=2 with cpu_fsdp2_cp2.yaml: each rank holds 3 of the 6 experts of every layer
    and its chunks of every row; tokens cross to their experts' rank and back (before: no ep)."""
    run, reference = launched("moe/ep2-cp2"), launched("moe/reference")
    lines = [line for line in run.stderr.splitlines() if PREPARED in line]
    assert len(lines) == 1 and "cp=2" in lines[0], run.stderr
    assert "ep=2 (experts: 3 of 6 per rank per layer, all-to-all; their FSDP2 units over 1 rank)" in lines[0], lines[0]
    assert_same_training(run.out, reference.out, rtol=1e-5)
    from safetensors.torch import load_file

    saved = load_file(run.out / "model.safetensors")
    assert {key.split(".")[5] for key in saved if key.startswith("model.layers.0.mlp.experts.")} == set("012345")


@pytest.mark.parametrize("name, oracle", [
    pytest.param("moe/ep2-global", "moe/reference", marks=runs("moe/reference", "moe/ep2-global"), id="ep2-global"),
    pytest.param("moe/fsdp2-ga2-global", "moe/reference-ga2", marks=runs("moe/reference-ga2", "moe/fsdp2-ga2-global"),
                 id="dp2-ga2-global"),
    pytest.param("moe/dp2-cp2-ep2-global", "moe/reference", marks=runs("moe/reference", "moe/dp2-cp2-ep2-global"),
                 id="dp2-cp2-ep2-global"),
])
def test_the_routers_loss_over_the_global_batch_is_counted_once_at_every_layout(launched, name, oracle):
    """QWEN35_ACCEL_MOE_BALANCE=global (the router's loss of the global batch, its sums all-reduced):
    ep 2 over dp 2, dp 2 with 2 accumulated micro-batches, dp 2 x cp 2 with ep 2 (world 4) log one
    process's loss and grad norm at every step and save its weights, routers included (before: stock's
    loss scaling counted the router term once per process, 0.1 off at world 2, 0.3 at world 4)."""
    run, reference = launched(name), launched(oracle)
    assert run.stderr.count(PREPARED) == 1, run.stderr[-3000:]
    assert_same_training(run.out, reference.out, rtol=1e-5)


@runs("moe/ep2-cp2", "moe/cp2-from-ep2", "moe/cp2", "moe/ep2-from-cp2")
def test_a_checkpoint_saved_under_ep2_resumes_without_ep_and_back(launched):
    """The Trainer's step-2 checkpoint (model and optimizer state, gathered whole) of the ep 2 run
    resumes under cp 2 without ep, and the cp 2 run's under ep 2: steps 3-4 repeat the uninterrupted
    run's losses and grad norms, and the saved weights equal (fp32 rtol 1e-5: the layouts sum the
    experts' gradients in another order; plain SGD, see test_trainer_launch)."""
    _assert_resumed(launched, (("moe/cp2-from-ep2", "moe/ep2-cp2"), ("moe/ep2-from-cp2", "moe/cp2")))


def _assert_resumed(launched, pairs: tuple[tuple[str, str], ...]) -> None:
    """Each (resumed, uninterrupted) pair: steps 3-4's losses and grad norms and the saved weights equal."""
    for resumed, full in pairs:
        a, b = launched(resumed), launched(full)
        assert (b.out / "checkpoint-2").is_dir()
        assert ("ep=2 (experts" in a.stderr) is ("from-cp2" in resumed), a.stderr[-2000:]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(losses(a.out, key)[-2:]), torch.tensor(losses(b.out, key)[-2:]),
                                       rtol=1e-5, atol=0, msg=lambda m, key=key: f"{resumed} {key}: {m}")
        from safetensors.torch import load_file

        got, want = load_file(a.out / "model.safetensors"), load_file(b.out / "model.safetensors")
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{resumed} {key}: {m}")


def test_trl_sft_cli_on_moe_under_cp2_and_ep2_logs_what_one_process_logs(tmp_path):
    """TRL's own `trl sft` (SFTConfig's defaults: Transformers' gradient checkpointing, the prompt
    masked) on a tiny Qwen3.5-MoE, unchanged: one process against `--accelerate_config
    cpu_fsdp2_cp2.yaml` with QWEN35_ACCEL_EP=2 (each rank its chunks of every row and 3 of the 6
    experts of every layer): loss, grad norm, entropy, mean_token_accuracy, num_tokens."""
    import shutil

    from _parity import assert_same_log_history, log_history
    from _trl_cli import RECIPES, four_sgd_steps, single_and_cp2
    from transformers import AutoTokenizer

    model, data = tmp_path / "model", tmp_path / "data"
    save_tiny_moe(model)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(model)
    data.mkdir()
    shutil.copy(RECIPES / "data" / "sft_tiny.jsonl", data / "train.jsonl")
    single, cp2, output = single_and_cp2(tmp_path, "sft", four_sgd_steps(model, data), step=4, cp2_env=EP2)
    assert output.count("prepared by qwen35_accel") == 1 and "cp=2" in output and "ep=2 (experts: 3 of 6" in output, output[-3000:]
    logged = log_history(single)
    losses = [e["loss"] for e in logged if "loss" in e]
    assert len(losses) == 4 and losses[-1] < losses[0] and any(e.get("mean_token_accuracy", 0) > 0 for e in logged), logged
    # fp32 rtol 1e-5: the reduction order of cp's per-chunk partial gradients and of the experts' (ep).
    assert_same_log_history(cp2, single, rtol=1e-5, atol=1e-6)


def test_trl_sft_cli_on_moe_under_dp2_with_accumulation_logs_what_one_process_logs(tmp_path):
    """`trl sft` (the router's loss on, TRL's default coefficient: the model's 0.05) under cpu_fsdp2.yaml,
    2 micro-batches of 2 rows per rank, against one process with the same 4 micro-batches: TRL adds
    `coef x aux / accumulation` itself, each rank's router loss, so the step's router term is the mean of
    the four (docs/moe.md) in both. Loss, grad norm, aux_loss, num_tokens per step; entropy and
    accuracy are left out (one process logs the mean of its micro-batches' ratios, dp 2 one ratio of the
    ranks' summed counts per micro-step)."""
    import shutil

    from _parity import assert_same_log_history, log_history
    from _trl_cli import RECIPES, four_sgd_steps, single_and_cp2
    from transformers import AutoTokenizer

    model, data = tmp_path / "model", tmp_path / "data"
    save_tiny_moe(model)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(model)
    data.mkdir()
    shutil.copy(RECIPES / "data" / "sft_tiny.jsonl", data / "train.jsonl")
    per_device = ("--per_device_train_batch_size", "2")
    single, dp2, output = single_and_cp2(
        tmp_path, "sft", four_sgd_steps(model, data), step=4, config="cpu_fsdp2.yaml",
        single_args=(*per_device, "--gradient_accumulation_steps", "4"), launched_args=(*per_device, *GA2),
    )
    assert output.count("prepared by qwen35_accel") == 1, output[-3000:]
    assert all("aux_loss" in e for e in log_history(single) if "loss" in e), log_history(single)
    assert_same_log_history(dp2, single, rtol=1e-5, atol=1e-6, skip=("entropy", "mean_token_accuracy"))


@runs("moe/reference-ga2", "moe/dp2xtp2")
def test_a_qwen35_moe_model_under_dp2_x_tp2_trains_as_one_process(launched):
    """cpu_fsdp2_tp2.yaml (before: Accelerate's own path, Transformers' TP plan, gates as loaded):
    each tp rank holds half the heads, half the shared expert and 3 of the 6 routed experts."""
    run, reference = launched("moe/dp2xtp2"), launched("moe/reference-ga2")
    lines = [line for line in run.stderr.splitlines() if PREPARED in line]
    assert len(lines) == 1 and "Qwen3_5MoeForCausalLM prepared by qwen35_accel" in lines[0] and "tp=2" in lines[0], run.stderr
    assert "experts: 3 of 6 per rank per layer, split over the tp ranks" in lines[0], lines[0]
    assert_same_training(run.out, reference.out, rtol=1e-5)


@runs("moe8/reference-ga2", "moe8/ep2xtp2", "moe8/tp2-from-ep2xtp2")
def test_a_qwen35_moe_model_under_ep2_x_tp2_trains_as_one_process_and_resumes_under_tp2(launched):
    """cpu_fsdp2_tp2.yaml with QWEN35_ACCEL_EP=2: every rank holds 2 of the 8 experts of each layer,
    whole, the Trainer's gradient norm (clipped at its default 1.0) spans the tp ranks' pieces
    (every gradient lives on one device mesh), and the saved weights are one process's; its step-2
    checkpoint resumes under tp 2 without ep (the experts FSDP2-sharded again) as if uninterrupted."""
    run, reference = launched("moe8/ep2xtp2"), launched("moe8/reference-ga2")
    lines = [line for line in run.stderr.splitlines() if PREPARED in line]
    assert len(lines) == 1 and "tp=2" in lines[0], run.stderr
    assert "ep=2 (experts: 2 of 8 per rank per layer, split over ep 2 x tp 2" in lines[0], lines[0]
    assert_same_training(run.out, reference.out, rtol=1e-5)
    _assert_resumed(launched, (("moe8/tp2-from-ep2xtp2", "moe8/ep2xtp2"),))
