"""TRL's `GRPOTrainer` and `RLOOTrainer` under context and tensor parallelism, launched as a user
launches them (tests/scripts/trl_grpo.py, unchanged between runs), against the run without cp/tp on
the same global batch: cp 2 (dp 1) = one process, dp 2 × cp 2 = dp 2, dp 2 × tp 2 = dp 2. Each
rank trains on the completions the process of its data-parallel index draws in that run, token for
token, and every value logged per step (loss, grad_norm, reward, reward_std, rewards/*, kl, entropy,
clip ratios, completion lengths and clipped ratio, num_tokens) is that run's.

Variants (tests/scripts/trl_grpo.py): `dapo_eval` (a reference model, beta 0.1; GRPO's own
evaluation after each step, its eval_* values compared too), `grpo` (num_iterations
2: old log-probs; gradient accumulation 2), `dr_grpo` (gradient accumulation 2, rewards scaled over
the batch), `rloo` (RLOOTrainer, beta 0.1). The toy prompts differ in length (TRL pads them on the
left); completions stop at EOS or are clipped at 8 tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launched import Run, register
from _parity import assert_same_log_history, log_history
from _trl_cli import RECIPES, saved_tiny_model, single_and_cp2

from qwen35_accel.testing.launch import REPO, accelerate_launch_command, assert_refused_on_every_rank, run_launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch

SCRIPT = REPO / "tests" / "scripts" / "trl_grpo.py"
PREPARED = "Qwen3_5ForCausalLM prepared by qwen35_accel"
PER_DEVICE = "4"  # one prompt's 4 generations per data-parallel replica and step
CP_VARIANTS = "dapo_eval,grpo,dr_grpo,rloo"
DP_VARIANTS = "dapo_eval,grpo,dr_grpo"
TP_VARIANTS = "dapo_eval,grpo"
SPLIT = {"QWEN35_ACCEL_RL_GENERATION": "split"}  # per-row sampling, the group's rows split over its cp ranks
SPLIT_VARIANTS = "dapo_eval,grpo,rloo"
SPLIT_DP_VARIANTS = "dapo_eval"
MOE_VARIANTS = "dapo_eval,rloo"
register(**{
    "grpo/single": Run(None, SCRIPT, ("{out}", PER_DEVICE, "--variants", CP_VARIANTS)),
    "grpo/cp2": Run("cpu_fsdp2_cp2.yaml", SCRIPT, ("{out}", PER_DEVICE, "--variants", CP_VARIANTS)),
    "grpo/dp2": Run("cpu_fsdp2.yaml", SCRIPT, ("{out}", PER_DEVICE, "--variants", DP_VARIANTS)),
    "grpo/dp2xcp2": Run("cpu_fsdp2_dp2_cp2.yaml", SCRIPT, ("{out}", PER_DEVICE, "--variants", DP_VARIANTS)),
    "grpo/dp2xtp2": Run("cpu_fsdp2_tp2.yaml", SCRIPT, ("{out}", PER_DEVICE, "--variants", TP_VARIANTS)),
    "grpo/single-split": Run(None, SCRIPT, ("{out}", PER_DEVICE, "--variants", SPLIT_VARIANTS), env=SPLIT),
    "grpo/cp2-split": Run("cpu_fsdp2_cp2.yaml", SCRIPT, ("{out}", PER_DEVICE, "--variants", SPLIT_VARIANTS), env=SPLIT),
    "grpo/dp2-split": Run("cpu_fsdp2.yaml", SCRIPT, ("{out}", PER_DEVICE, "--variants", SPLIT_DP_VARIANTS), env=SPLIT),
    "grpo/dp2xcp2-split": Run("cpu_fsdp2_dp2_cp2.yaml", SCRIPT, ("{out}", PER_DEVICE, "--variants", SPLIT_DP_VARIANTS),
                              env=SPLIT),
    # Qwen3.5-MoE (TRL adds the router's loss) under dp 2, its experts gathered by FSDP2 or split by ep 2.
    "grpo/moe-dp2": Run("cpu_fsdp2.yaml", SCRIPT, ("{out}", PER_DEVICE, "--variants", MOE_VARIANTS, "--moe")),
    "grpo/moe-ep2": Run("cpu_fsdp2.yaml", SCRIPT, ("{out}", PER_DEVICE, "--variants", MOE_VARIANTS, "--moe"),
                        env={"QWEN35_ACCEL_EP": "2"}),
})


def _assert_same_completions_and_log(got: Path, want: Path, variants: str, replicas: int, ranks: int) -> None:
    """`got`'s ranks (a cp×tp group per replica, rank-major) trained on `want`'s completions (one
    process per replica) and logged `want`'s values."""
    share = ranks // replicas
    for variant in variants.split(","):
        for rank in range(ranks):
            seen, drawn = (json.loads((d / variant / f"completions-rank{r}.json").read_text())
                           for d, r in ((got, rank), (want, rank // share)))
            assert seen == drawn, f"{variant}: rank {rank} trained on other completions than replica {rank // share}"
        # fp32 rtol 1e-5: the sharded decoder's reduction order; atol 1e-6: losses and advantages
        # near zero (a group's mean is subtracted), KL of ~1e-4. step_time is a wall time.
        assert_same_log_history(got / variant, want / variant, rtol=1e-5, atol=1e-6, skip=("step_time",))


@pytest.mark.launches("grpo/single", "grpo/cp2")
def test_grpo_and_rloo_under_cp2_equal_one_process_completion_for_completion(launched):
    launch, one_process = launched("grpo/cp2"), launched("grpo/single").out
    out = launch.out
    assert launch.stderr.count(PREPARED) == 7, "policy and reference models: qwen35_accel's units (grpo has no reference)"
    _assert_same_completions_and_log(out, one_process, CP_VARIANTS, replicas=1, ranks=2)
    logged = [e for e in log_history(out / "dapo_eval") if "kl" in e]
    assert any("eval_loss" in e for e in log_history(out / "dapo_eval")), "no evaluation ran"
    assert logged[0]["kl"] == 0.0 and logged[1]["kl"] > 0, "the reference model is the policy before its first update"
    dapo = log_history(one_process / "dapo_eval")[0]
    assert 0 < dapo["completions/clipped_ratio"] < 1, "completions both stop at EOS and are clipped"
    assert dapo["completions/min_length"] < dapo["completions/max_length"]


@pytest.mark.parametrize("case,variants", [
    pytest.param(case, variants, marks=pytest.mark.launches("grpo/dp2", f"grpo/{case}"), id=case)
    for case, variants in (("dp2xcp2", DP_VARIANTS), ("dp2xtp2", TP_VARIANTS))
])
def test_grpo_under_dp2_times_cp2_or_tp2_equals_dp2(launched, case, variants):
    _assert_same_completions_and_log(launched(f"grpo/{case}").out, launched("grpo/dp2").out, variants, replicas=2, ranks=4)


@pytest.mark.launches("grpo/moe-dp2", "grpo/moe-ep2")
def test_grpo_and_rloo_on_moe_under_ep2_equal_dp2_completion_for_completion(launched):
    """Under ep 2 each rank holds half the experts and generates with them (the all-to-alls in every
    decoding step: Transformers keeps the ranks' forwards in step under FSDP2); it trains on the
    completions dp 2 (every expert gathered) draws and logs its values, the router's loss included."""
    ep, dp = launched("grpo/moe-ep2"), launched("grpo/moe-dp2")
    assert "ep=2 (experts: 3 of 6" in ep.stderr and "ep=2 (experts" not in dp.stderr, ep.stderr[-2000:]
    _assert_same_completions_and_log(ep.out, dp.out, MOE_VARIANTS, replicas=2, ranks=2)
    assert any(e.get("aux_loss", 0) > 0 for e in log_history(dp.out / "dapo_eval")), "TRL added no router loss"


@pytest.mark.launches("grpo/single", "grpo/single-split", "grpo/cp2-split")
def test_split_generation_under_cp2_draws_the_one_process_per_row_completions(launched):
    """QWEN35_ACCEL_RL_GENERATION=split: each cp rank generates half of the group's rows with
    per-row sampling, the group gathers them; the one-process run with the same setting (per-row
    sampling, every row in one call) trained on the same completions and logged the same values.
    Other completions than TRL's own sampling (the setting took effect in the one-process run)."""
    split, one_process = launched("grpo/cp2-split"), launched("grpo/single-split")
    assert "each of the 2 cp ranks generates 2-2 of the group's 4 rows" in split.stderr, split.stderr[-2000:]
    _assert_same_completions_and_log(split.out, one_process.out, SPLIT_VARIANTS, replicas=1, ranks=2)
    stock = json.loads((launched("grpo/single").out / "dapo_eval" / "completions-rank0.json").read_text())
    per_row = json.loads((one_process.out / "dapo_eval" / "completions-rank0.json").read_text())
    assert [c["prompt"] for c in per_row] == [c["prompt"] for c in stock]
    assert [c["completion_ids"] for c in per_row] != [c["completion_ids"] for c in stock]


@pytest.mark.launches("grpo/dp2-split", "grpo/dp2xcp2-split")
def test_split_generation_under_dp2_times_cp2_equals_dp2(launched):
    """Each replica seeds its rows by their global index (dp index × rows + row): dp 2 × cp 2 with
    split generation draws, per replica, what dp 2 draws."""
    _assert_same_completions_and_log(launched("grpo/dp2xcp2-split").out, launched("grpo/dp2-split").out,
                                     SPLIT_DP_VARIANTS, replicas=2, ranks=4)


@pytest.mark.parametrize("args,message", [
    (("2",), "the generation batch counts data-parallel replicas (dp=1, not the 2 processes): "
     "per_device_train_batch_size (2) x dp (1) x steps_per_generation (1) = 2, which num_generations (4) does not divide"),
    (("4", "--variants", "dapo_eval", "--eval-per-device", "2"), "an evaluation batch counts data-parallel replicas "
     "(dp=1, not the 2 processes): per_device_eval_batch_size (2) x dp (1) = 2, which the evaluation's generations "
     "per prompt (4) do not divide"),
], ids=["train", "eval"])
def test_a_batch_that_does_not_fit_the_replicas_is_refused_on_every_rank(tmp_path, args, message):
    """2 rows per device, 4 generations per prompt: TRL counts 2 processes (4 rows, divisible), but
    the cp ranks hold the same rows, so each step (or evaluation batch) would hold half a group:
    refused before any step."""
    result = run_launch(accelerate_launch_command("cpu_fsdp2_cp2.yaml", SCRIPT, str(tmp_path / "cp2"), *args))
    assert_refused_on_every_rank(result, "ValueError", f"GRPOTrainer under cp/tp: {message}")


def test_trl_grpo_cli_with_a_reward_from_a_module_path_under_cp_logs_what_one_process_logs(tmp_path):
    """TRL's own `trl grpo` (its script: the model and tokenizer from a folder, a dataset folder, a
    reward function by dotted import path), unchanged: `--accelerate_config` with the cp 2 YAML
    against the same command without it (one process; HF_HOME in tmp_path so no user default
    config applies). The checkpoint's log history compared."""
    model = saved_tiny_model(tmp_path / "model", eos_token_ids=range(60, 99))  # some completions stop early
    data = tmp_path / "data"
    data.mkdir()
    records = [json.loads(line) for line in (RECIPES / "data" / "sft_tiny.jsonl").read_text().splitlines()[:16]]
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in records))
    (tmp_path / "cli_rewards.py").write_text("def length(completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n")
    common = [
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--reward_funcs", "cli_rewards.length",
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_completion_length", "8", "--beta", "0.1", "--optim", "sgd", "--learning_rate", "0.1", "--seed", "0",
        "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2", "--save_only_model", "True",
        "--report_to", "none", "--dtype", "float32", "--attn_implementation", "sdpa", "--bf16", "False",
    ]
    single, cp2, output = single_and_cp2(tmp_path, "grpo", common, step=2)
    assert output.count(PREPARED) == 2, output[-3000:]  # policy and reference
    logged = log_history(single)
    assert sum("loss" in e for e in logged) == 2 and logged[1]["kl"] > 0, logged
    assert_same_log_history(cp2, single, rtol=1e-5, atol=1e-6, skip=("step_time",))
