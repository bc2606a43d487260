"""TRL's `DPOTrainer` and `KTOTrainer`, unchanged (tests/scripts/trl_dpo.py, trl_kto.py), under
context parallelism (cp 2; DPO also dp 2 × cp 2) and DPO under tensor parallelism (dp 2 × tp 2,
with and without the vocab-parallel lm_head; cp 2 × tp 2) through `accelerate launch`, against
one process on the same global batch (and TRL's own `trl dpo` CLI through `--accelerate_config`
with the cp 2 YAML against the same command without it):
every value TRL and the Trainer log per step (`trainer_state.json`, training and evaluation) —
loss, grad norm, `rewards/*`, `logps/*`, `logits/*`, `entropy`, `mean_token_accuracy`, KTO's
`kl`, and the counts (`num_tokens`, exactly).

Each cp rank holds the same whole rows; TRL's fused head shards them on entry and gathers the
per-token fields back (`integrations/trl/whole_rows.py`). TRL's metric gathers inside these
trainers would return each row cp times: `num_tokens` doubles, and precomputed reference
log-probs (`*-precompute` variants) come back duplicated and land on other rows; under tp the
same for the precomputed reference log-probs (TRL divides its token count by tp itself).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _launched import Run, register
from _parity import assert_same_log_history, log_history
from _trl_cli import RECIPES, four_sgd_steps, saved_tiny_model, single_and_cp2

from qwen35_accel.testing.launch import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch: each test launches worlds

DPO, KTO = REPO / "tests" / "scripts" / "trl_dpo.py", REPO / "tests" / "scripts" / "trl_kto.py"
DPO_ARGS = ("--variants", "sigmoid,ipo,sigmoid-precompute", "--eval")
KTO_VARIANTS = "kto,kto-precompute"
# cp 2 × tp 2: the shipped dp 2 × cp 2 YAML (world 4) with dp_shard 1 and tp 2, as its
# parallelism_config keys reach Accelerate (`accelerate launch` turns them into these variables).
CP2_TP2 = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_TP_SIZE": "2"}
DPO_CASES = {  # id: config, per-device batch (the one process's 4 rows in all), environment, the plugin's note
    "cp2": ("cpu_fsdp2_cp2.yaml", "4", {}, "cp=2, tp=1"),
    "dp2xcp2": ("cpu_fsdp2_dp2_cp2.yaml", "2", {}, "cp=2, tp=1"),
    "dp2xtp2": ("cpu_fsdp2_tp2.yaml", "2", {}, "cp=1, tp=2"),
    "dp2xtp2-vocab-parallel": ("cpu_fsdp2_tp2.yaml", "2", {"QWEN35_ACCEL_VOCAB_PARALLEL_LM_HEAD": "1"}, "cp=1, tp=2"),
    "cp2xtp2": ("cpu_fsdp2_dp2_cp2.yaml", "4", CP2_TP2, "cp=2, tp=2"),
}
register(**{
    "dpo/single": Run(None, DPO, ("{out}", "4", *DPO_ARGS)),  # the launches' global batch
    **{f"dpo/{case}": Run(config, DPO, ("{out}", per_device, *DPO_ARGS), env=env)
       for case, (config, per_device, env, _) in DPO_CASES.items()},
    "dpo/lora-single": Run(None, DPO, ("{out}", "4", "lora", "--variants", "sigmoid", "--eval")),
    "dpo/lora-cp2": Run("cpu_fsdp2_cp2.yaml", DPO, ("{out}", "4", "lora", "--variants", "sigmoid", "--eval")),
    # Qwen3.5-MoE with the router's loss (TRL adds it) under dp 2, its balance over the global batch.
    "dpo/moe-single": Run(None, DPO, ("{out}", "4", "--variants", "sigmoid", "--eval", "--moe")),
    "dpo/moe-dp2": Run("cpu_fsdp2.yaml", DPO, ("{out}", "2", "--variants", "sigmoid", "--eval", "--moe"),
                       env={"QWEN35_ACCEL_MOE_BALANCE": "global"}),
    "kto/single": Run(None, KTO, ("{out}", "4", KTO_VARIANTS)),
    "kto/cp2": Run("cpu_fsdp2_cp2.yaml", KTO, ("{out}", "4", KTO_VARIANTS)),
    "kto/moe-single": Run(None, KTO, ("{out}", "4", "kto", "--moe")),
    "kto/moe-dp2": Run("cpu_fsdp2.yaml", KTO, ("{out}", "2", "kto", "--moe"), env={"QWEN35_ACCEL_MOE_BALANCE": "global"}),
})


def _trained(out: Path, metric: str) -> None:
    """Four training steps and two evaluations logged, and the policy moved away from the reference."""
    logged = log_history(out)
    assert sum("loss" in e for e in logged) == 4 and sum("eval_loss" in e for e in logged) == 2, logged
    assert max(abs(e[metric]) for e in logged if metric in e) > 0, logged


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.launches("dpo/single", f"dpo/{case}"), id=case)
                                  for case in DPO_CASES])
def test_dpo_trainer_under_cp_and_tp_logs_what_one_process_logs(launched, case):
    """Sigmoid and IPO (which divides by the completions' lengths) with a reference model, and the
    reference log-probs precomputed over the dataset: one run, the variants one after the other.
    Under tp the tp ranks hold the same rows: TRL's fused head on the tp-split model (and over the
    vocab slices), the reference precompute's gathers counting each row once."""
    launch, single = launched(f"dpo/{case}"), launched("dpo/single").out
    notes = [line for line in launch.stderr.splitlines() if "prepared by qwen35_accel" in line]
    assert len(notes) == 6 and all(DPO_CASES[case][3] in n for n in notes), notes  # policy and reference, 3 variants
    for variant in DPO_ARGS[1].split(","):
        _trained(single / variant, "rewards/chosen")
        # fp32 rtol 1e-5: the reduction order over chunks and ranks; atol 1e-6: the rewards are
        # beta × (log-prob − reference log-prob), differences of terms of ~6 (beta 0.1 × ~60 nats).
        assert_same_log_history(launch.out / variant, single / variant, rtol=1e-5, atol=1e-6)


@pytest.mark.launches("dpo/lora-single", "dpo/lora-cp2")
def test_dpo_trainer_with_lora_under_cp_logs_what_one_process_logs(launched):
    """No reference model: TRL takes the reference log-probs from the policy with its adapters off."""
    single, cp2 = launched("dpo/lora-single").out, launched("dpo/lora-cp2").out
    _trained(single / "sigmoid", "rewards/chosen")
    assert_same_log_history(cp2 / "sigmoid", single / "sigmoid", rtol=1e-5, atol=1e-6)  # as above


@pytest.mark.launches("dpo/moe-single", "dpo/moe-dp2")
def test_dpo_trainer_on_moe_under_dp2_logs_what_one_process_logs(launched):
    """Qwen3.5-MoE, the router's load-balancing loss in DPO's loss (TRL's `aux_loss`). Under dp the
    router's loss keeps stock's per-rank meaning by default (each rank's rows: 3e-3 relative off one
    process's on the whole batch, and the loss with it); `QWEN35_ACCEL_MOE_BALANCE=global` balances
    over the global batch, as one process does."""
    launch, single = launched("dpo/moe-dp2"), launched("dpo/moe-single").out
    assert any("Qwen3_5MoeForCausalLM prepared by qwen35_accel" in line for line in launch.stderr.splitlines()), launch.stderr[-3000:]
    _trained(single / "sigmoid", "rewards/chosen")
    assert any(e.get("aux_loss", 0) > 0 for e in log_history(single / "sigmoid"))
    assert_same_log_history(launch.out / "sigmoid", single / "sigmoid", rtol=1e-5, atol=1e-6)  # as above


@pytest.mark.launches("kto/single", "kto/cp2")
def test_kto_trainer_under_cp_logs_what_one_process_logs(launched):
    """Rows of their own lengths (the plugin pads them to a multiple of 2·cp), the KL term from
    mismatched completions, with a reference model and with precomputed reference log-probs."""
    single, cp2 = launched("kto/single").out, launched("kto/cp2").out
    for variant in KTO_VARIANTS.split(","):
        _trained(single / variant, "rewards/chosen")
        # As DPO's; `kl` apart: a mean of (policy − reference) log-probs of ~40 nats each, ~0.2
        # after the updates: fp32 rounding of its terms (~3e-6) is its absolute noise.
        assert_same_log_history(cp2 / variant, single / variant, rtol=1e-5, atol=1e-6, skip=("kl", "eval_kl"))
        got, want = ([e.get("kl", e.get("eval_kl")) for e in log_history(d / variant) if "kl" in e or "eval_kl" in e]
                     for d in (cp2, single))
        assert any(k > 0 for k in want), want
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.launches("kto/moe-single", "kto/moe-dp2")
def test_kto_trainer_on_moe_under_dp2_logs_what_one_process_logs(launched):
    """Qwen3.5-MoE as policy and reference, the router's loss in KTO's loss (TRL's `aux_loss`, balanced
    over the global batch as one process does: QWEN35_ACCEL_MOE_BALANCE=global), the KL term from
    mismatched completions, under the plugin's FSDP2 units at dp 2."""
    launch, single = launched("kto/moe-dp2"), launched("kto/moe-single").out
    assert any("Qwen3_5MoeForCausalLM prepared by qwen35_accel" in line for line in launch.stderr.splitlines()), launch.stderr[-3000:]
    _trained(single / "kto", "rewards/chosen")
    assert any(e.get("aux_loss", 0) > 0 for e in log_history(single / "kto"))
    # `eval_kl` apart: TRL's collator pairs mismatched completions within each rank's batch (2 rows
    # here, 4 in one process), so under dp the KL estimate is over other pairs by construction.
    assert_same_log_history(launch.out / "kto", single / "kto", rtol=1e-5, atol=1e-6, skip=("kl", "eval_kl"))
    got, want = ([e["kl"] for e in log_history(d / "kto") if "kl" in e] for d in (launch.out, single))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _cli_inputs(root: Path) -> tuple[Path, Path]:
    """A saved tiny model (`_trl_cli.saved_tiny_model`) and a folder with `train.jsonl` of 32
    preference pairs (prompt, its completion, the next record's)."""
    model, data = saved_tiny_model(root / "model"), root / "data"
    records = [json.loads(line) for line in (RECIPES / "data" / "sft_tiny.jsonl").read_text().splitlines()[:33]]
    data.mkdir()
    (data / "train.jsonl").write_text("".join(
        json.dumps({"prompt": a["prompt"], "chosen": a["completion"], "rejected": b["completion"]}) + "\n"
        for a, b in zip(records, records[1:])))
    return model, data


def test_trl_dpo_cli_under_cp_logs_what_one_process_logs(tmp_path):
    """TRL's own `trl dpo` (its script, DPOConfig's defaults: Transformers' gradient checkpointing,
    the reference model loaded from the same folder), unchanged: `--accelerate_config` with the cp 2
    YAML against the same command without it (`accelerate launch` without a config: one process;
    HF_HOME in tmp_path so no user default config applies). The checkpoint's log history compared."""
    model, data = _cli_inputs(tmp_path)
    single, cp2, output = single_and_cp2(tmp_path, "dpo", four_sgd_steps(model, data), step=4)
    assert output.count("prepared by qwen35_accel") == 2 and "cp=2" in output, output[-3000:]  # policy and reference
    logged = log_history(single)
    assert sum("loss" in e for e in logged) == 4 and max(abs(e["rewards/chosen"]) for e in logged) > 0, logged
    assert_same_log_history(cp2, single, rtol=1e-5, atol=1e-6)  # as the script's runs above
