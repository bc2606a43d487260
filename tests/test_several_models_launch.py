"""A policy and a frozen reference model per run, against one process: TRL's `DPOTrainer`
with a `ref_model` (tests/scripts/trl_dpo.py) and a custom loop's
`accelerator.prepare(model, ref_model, optimizer)` (tests/scripts/two_models.py). GRPO's and
RLOO's reference models: tests/test_trl_sampling_launch.py."""

from __future__ import annotations

import json

import pytest
import torch
from _launched import Run, register
from _parity import assert_same_log_history, log_history

from qwen35_accel.testing.launch import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch: each test launches worlds

PREPARED = "Qwen3_5ForCausalLM prepared by qwen35_accel"
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected", "num_tokens")
DPO, TWO_MODELS = REPO / "tests" / "scripts" / "trl_dpo.py", REPO / "tests" / "scripts" / "two_models.py"
register(**{
    "ref/dpo-single": Run(None, DPO, ("{out}", "4")),  # = the launches' global batch
    "ref/dpo-fsdp2": Run("cpu_fsdp2.yaml", DPO, ("{out}", "2")),
    "ref/dpo-dp2xtp2": Run("cpu_fsdp2_tp2.yaml", DPO, ("{out}", "2")),
    "ref/two-models-single": Run(None, TWO_MODELS, ("{out}",)),
    "ref/two-models-fsdp2": Run("cpu_fsdp2.yaml", TWO_MODELS, ("{out}",)),
    "ref/two-models-cp2": Run("cpu_fsdp2_cp2.yaml", TWO_MODELS, ("{out}",)),
})


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.launches("ref/dpo-single", f"ref/dpo-{case}"), id=case)
                                  for case in ("fsdp2", "dp2xtp2")])
def test_dpo_trainer_with_a_reference_model_matches_one_process(launched, case):
    launch, single = launched(f"ref/dpo-{case}"), launched("ref/dpo-single").out
    assert launch.stderr.count(PREPARED) == 2, "the reference model did not get qwen35_accel's units"
    logged = [e for e in log_history(launch.out) if "loss" in e]
    assert len(logged) == 4 and all(key in logged[0] for key in DPO_METRICS)
    assert max(abs(e["rewards/chosen"]) for e in logged[1:]) > 0  # the policy moved away from the reference
    # Every logged value per step (loss, grad_norm, rewards, log-probs, logits, TRL's token counts):
    # fp32 rtol 1e-5: FSDP2's (and tp's) reduction order; atol 1e-6: rewards/margins is chosen minus
    # rejected rewards (each up to ~0.25, so 1e-5 of them), and the first step's rewards are zero.
    assert_same_log_history(launch.out, single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.launches("ref/two-models-single", f"ref/two-models-{case}"), id=case)
    for case in ("fsdp2", "cp2")])
def test_prepare_with_a_frozen_reference_model_prepares_both_and_matches_one_process(launched, case):
    launch = launched(f"ref/two-models-{case}")
    assert launch.stderr.count(PREPARED) == 2
    got, want = (json.loads((d / "losses.json").read_text()) for d in (launch.out, launched("ref/two-models-single").out))
    assert got["prepared"] == [True, True]
    for key in ("policy", "reference"):
        # fp32 rtol 1e-5: reduction order over ranks (dp) or chunks (cp), 3 SGD steps.
        torch.testing.assert_close(torch.tensor(got["losses"][key]), torch.tensor(want["losses"][key]), rtol=1e-5, atol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")
