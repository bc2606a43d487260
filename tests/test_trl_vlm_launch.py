"""TRL's `SFTTrainer` on the Qwen3.5 VLM class (`Qwen3_5ForConditionalGeneration`), unchanged
(tests/scripts/trl_sft_vlm.py: a processor built in code, TRL's vision-language collator, images
of 8 sizes, rows without one), through `accelerate launch` against the same script without CP:
every value TRL and the Trainer log per step.

The VLM class declares `accepts_loss_kwargs = False`, so the Trainer passes SFTTrainer no
`num_items_in_batch` and TRL divides by each rank's own label count. Under CP each rank holds
other chunks of the same rows: before `integrations/trl/fused_head.sft_compute_loss`, cp 2 logged step 1's
grad norm 1.81125 against one process's 1.77462 (with images; text-only rows 1.3931 against
1.3862 in the issue's run), while the plain Trainer was exact (the model's own loss reduces
over the cp group).

The fused head × model class × layout matrix TRL's trainers reach, and where each cell is tested:

| fused-head caller | causal LM | VLM, text rows | VLM, images |
|---|---|---|---|
| SFT, Trainer-sharded rows | cp2, dp2×cp2, dp2×tp2, vocab-parallel (test_trl_launch) | cp2 (here) | cp2, dp2×cp2, cp2×tp2 (here) |
| DPO/KTO, whole rows | cp2, cp2×tp2 (test_trl_preference_launch) | DPO cp2 (here) | DPO cp2: refused on every rank (here) |
| GRPO/RLOO, whole rows | cp2, dp2×cp2, dp2×tp2 (test_trl_sampling_launch) | GRPO cp2 (here) | GRPO cp2: refused on every rank (here) |

A new combination lands with a cell here, or stays "not tested" in docs/vlm.md. The MoE VLM class:
SFT with images under cp 2 × ep 2 (here).
"""

from __future__ import annotations

import pytest
from _launched import Run, register
from _parity import assert_same_log_history, log_history

from qwen35_accel.testing.launch import REPO, accelerate_launch_command, assert_refused_on_every_rank, run_launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch

SCRIPT = REPO / "tests" / "scripts" / "trl_sft_vlm.py"
OTHERS = REPO / "tests" / "scripts" / "trl_vlm_images.py"  # DPO and GRPO

register(**{
    "trl_vlm/single": Run(None, SCRIPT, ("{out}", "2")),
    "trl_vlm/cp2": Run("cpu_fsdp2_cp2.yaml", SCRIPT, ("{out}", "2")),
    "trl_vlm/single-text": Run(None, SCRIPT, ("{out}", "2", "--text_only")),
    "trl_vlm/cp2-text": Run("cpu_fsdp2_cp2.yaml", SCRIPT, ("{out}", "2", "--text_only")),
    # The VLM's loss is each data-parallel rank's mean (stock): dp 2 × cp 2's oracle is dp 2.
    "trl_vlm/dp2": Run("cpu_fsdp2.yaml", SCRIPT, ("{out}", "2")),
    "trl_vlm/dp2xcp2": Run("cpu_fsdp2_dp2_cp2.yaml", SCRIPT, ("{out}", "2")),
    # The 4-rank config with dp_shard 1 and tp 2: cp 2 x tp 2, one replica (one process's batch).
    "trl_vlm/cp2xtp2": Run("cpu_fsdp2_dp2_cp2.yaml", SCRIPT, ("{out}", "2"),
                           env={"PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_TP_SIZE": "2"}),
    # The MoE VLM class with images: one process against cp 2 x ep 2 (each rank its chunks and 3 of 6 experts).
    "trl_vlm/moe-single": Run(None, SCRIPT, ("{out}", "2", "--moe")),
    "trl_vlm/moe-cp2-ep2": Run("cpu_fsdp2_cp2.yaml", SCRIPT, ("{out}", "2", "--moe"), env={"QWEN35_ACCEL_EP": "2"}),
    **{f"trl_vlm/{kind}-{where}": Run(config, OTHERS, ("{out}", kind, "--text_only"))
       for kind in ("dpo", "grpo") for where, config in (("single", None), ("cp2", "cpu_fsdp2_cp2.yaml"))},
})


def assert_trained_alike(got, want) -> None:
    logged = log_history(want)
    losses = [e["loss"] for e in logged if "loss" in e]
    assert len(losses) == 4 and losses[-1] < losses[0], logged  # it trained
    assert sum("mean_token_accuracy" in e and "entropy" in e and "num_tokens" in e for e in logged) == 4, logged
    # fp32 rtol 1e-5: the reduction order of the cp ranks' partial gradients (and sums of metrics).
    assert_same_log_history(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("got,want", [
    pytest.param("trl_vlm/cp2", "trl_vlm/single", marks=pytest.mark.launches("trl_vlm/single", "trl_vlm/cp2"), id="cp2-images"),
    pytest.param("trl_vlm/cp2-text", "trl_vlm/single-text",
                 marks=pytest.mark.launches("trl_vlm/single-text", "trl_vlm/cp2-text"), id="cp2-text-rows"),
    pytest.param("trl_vlm/cp2xtp2", "trl_vlm/single", marks=pytest.mark.launches("trl_vlm/single", "trl_vlm/cp2xtp2"),
                 id="cp2xtp2-images"),
    pytest.param("trl_vlm/dp2xcp2", "trl_vlm/dp2", marks=pytest.mark.launches("trl_vlm/dp2", "trl_vlm/dp2xcp2"),
                 id="dp2xcp2-images"),
])
def test_sft_trainer_on_the_vlm_under_cp_logs_what_one_replica_logs(launched, got, want):
    assert_trained_alike(launched(got).out, launched(want).out)


@pytest.mark.parametrize("kind,message", [
    ("dpo", "TRL's fused head on whole rows under context parallelism shards input_ids, attention_mask, position_ids, "
     "labels; this call also passes per-token mm_token_type_ids, which it would not shard (TRL's vision-language "
     "collators pass them for rows with images or videos"),
    ("grpo", "GRPOTrainer on a vision-language model under context parallelism (cp_size=2) is not supported"),
], ids=["dpo", "grpo"])
def test_preference_and_rl_trainers_with_images_under_cp_are_refused_on_every_rank(tmp_path, kind, message):
    """TRL's DPOTrainer and GRPOTrainer on the VLM with image rows (tests/scripts/trl_vlm_images.py, which
    trains in one process) under cp 2: refused before the first step, on every rank, with the reason."""
    script = REPO / "tests" / "scripts" / "trl_vlm_images.py"
    result = run_launch(accelerate_launch_command("cpu_fsdp2_cp2.yaml", script, str(tmp_path), kind))
    assert_refused_on_every_rank(result, "NotImplementedError", message)


@pytest.mark.parametrize("kind", [
    pytest.param(kind, marks=pytest.mark.launches(f"trl_vlm/{kind}-single", f"trl_vlm/{kind}-cp2"), id=kind)
    for kind in ("dpo", "grpo")
])
def test_dpo_and_grpo_on_the_vlms_text_rows_under_cp_log_what_one_process_logs(launched, kind):
    """The VLM class with text-only rows (the tokenizer as the processing class): the whole-row fused head
    (DPO) and replicated generation (GRPO) under cp 2 log one process's values, rtol 1e-5."""
    got, want = launched(f"trl_vlm/{kind}-cp2").out, launched(f"trl_vlm/{kind}-single").out
    logged = [e for e in log_history(want) if "loss" in e]
    assert len(logged) == 2 and all(e["grad_norm"] > 0 for e in logged), logged
    assert_same_log_history(got, want, rtol=1e-5, atol=1e-6, skip=("step_time",))  # GRPO's wall time


@pytest.mark.launches("trl_vlm/moe-single", "trl_vlm/moe-cp2-ep2")
def test_sft_trainer_on_the_moe_vlm_with_images_under_cp2_and_ep2_logs_what_one_process_logs(launched):
    """Qwen3_5MoeForConditionalGeneration through SFTTrainer with images: every value logged, the
    router's load-balancing loss (`aux_loss`, its sums over the cp group) included."""
    run = launched("trl_vlm/moe-cp2-ep2")
    assert "Qwen3_5MoeForConditionalGeneration prepared by qwen35_accel" in run.stderr and "ep=2 (experts: 3 of 6" in run.stderr
    assert any("aux_loss" in e for e in log_history(launched("trl_vlm/moe-single").out))
    assert_trained_alike(run.out, launched("trl_vlm/moe-single").out)
