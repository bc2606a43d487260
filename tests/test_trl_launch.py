"""TRL's `SFTTrainer`, unchanged (tests/scripts/trl_sft.py), through `accelerate launch`
against one process on the same global batch (and TRL's own `trl sft` CLI with the cp 2 YAML
against the same command without it): every value TRL and the Trainer log per step
(`trainer_state.json`, training and evaluation) — the loss, grad norm, TRL's `entropy`,
`mean_token_accuracy` and `num_tokens`, `eval_loss` and TRL's eval metrics, and for
padded rows the Trainer's `total_flos`.

TRL sums per-rank counts (label tokens, top-1 hits, entropy, attention mask) through
`Accelerator.gather_for_metrics`: under CP every cp rank holds other tokens of the same
rows, so those sums must span every process (stock gathering), while the evaluation loop's
own gathering (losses, predictions) must count each row once. With the old patch of
`gather_for_metrics` (data-parallel ranks only, for every caller) cp 2 padding-free logged
`mean_token_accuracy` [0, 0.136, 0.182, 0.154] against [0, 0.071, 0.151, 0.261] and
`num_tokens` 304 against 600 after 4 steps; dp 2 × tp 2 `num_tokens` 299 against 600.

Padding-free rows hold the same examples as padded batches, so their oracle is the padded
single-process run of unmodified Transformers + TRL. Packed rows (TRL's BFD packing) have
no padded equivalent; their oracle is one process whose GatedDeltaNet layers compute
packed rows document by document (`install_fp32_gate`, checked against the unmodified
model document by document in tests/test_packing.py). TRL refuses packing under context
parallelism by its own check; padding-free batches it passes, and they run under cp 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _launched import Run, register
from _parity import assert_same_log_history, log_history
from _trl_cli import RECIPES, four_sgd_steps, saved_tiny_model, single_and_cp2

from qwen35_accel.testing.launch import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # accelerate launch: each test launches worlds

SCRIPT = REPO / "tests" / "scripts" / "trl_sft.py"


def assert_same_log(got: Path, want: Path, rtol: float, skip: tuple[str, ...] = (), flos: bool = True) -> None:
    """Every logged value equal to one process's, and every metric there: 4 training steps,
    2 evaluations. `flos`: the Trainer's `total_flos` too (exactly: the script pads every
    padded batch to 62 positions, so every rank's batch shape adds up to one process's;
    Transformers sums the ranks' counts in float32, exact for the tiny model's)."""
    logged = log_history(want)
    assert sum("mean_token_accuracy" in e for e in logged) == 4 and sum("eval_mean_token_accuracy" in e for e in logged) == 2
    losses = [e["loss"] for e in logged if "loss" in e]
    assert losses[-1] < losses[0] and any(e.get("mean_token_accuracy", 0) > 0 for e in logged)  # it trained
    assert_same_log_history(got, want, rtol=rtol, skip=skip, flos=flos)


def runs(*names: str):
    return pytest.mark.launches(*names)


CASES = {  # id: config, mode, per-device batch, environment
    "fsdp2-padding-free": ("cpu_fsdp2.yaml", "padding_free", "2", {}),
    # TRL counts a padding-free row's tokens by its length unless it has an attention mask:
    # the row the plugin pads to a multiple of 2·cp must count only its own tokens.
    "cp2-padding-free": ("cpu_fsdp2_cp2.yaml", "padding_free", "4", {}),
    "cp2": ("cpu_fsdp2_cp2.yaml", "padded", "4", {}),
    "dp2xcp2": ("cpu_fsdp2_dp2_cp2.yaml", "padded", "2", {}),
    "dp2xtp2": ("cpu_fsdp2_tp2.yaml", "padded", "2", {}),
    # The tiny model's lm_head is untied: split by vocab, TRL's fused head must combine the
    # slices' log-probs, entropy and top-1 over the tp group.
    "dp2xtp2-vocab-parallel": ("cpu_fsdp2_tp2.yaml", "padded", "2", {"QWEN35_ACCEL_VOCAB_PARALLEL_LM_HEAD": "1"}),
}
# One launch per config (with the other modules' runs of that config); one process for the
# references (per-device 4 = every launch's global batch).
register(**{
    "trl/padded": Run(None, SCRIPT, ("{out}", "padded", "4")),
    "trl/lora-reference": Run(None, SCRIPT, ("{out}", "padded", "4", "--lora")),
    "trl/packing-reference": Run(None, SCRIPT, ("{out}", "packing", "4", "--packing_hook")),
    **{f"trl/{case}": Run(config, SCRIPT, ("{out}", mode, per_device), env=env)
       for case, (config, mode, per_device, env) in CASES.items()},
    "trl/lora-cp2": Run("cpu_fsdp2_cp2.yaml", SCRIPT, ("{out}", "padded", "4", "--lora")),
    "trl/packing": Run("cpu_fsdp2.yaml", SCRIPT, ("{out}", "packing", "2")),
})


@pytest.mark.parametrize(
    "case,mode", [pytest.param(case, c[1], marks=runs("trl/padded", f"trl/{case}"), id=case) for case, c in CASES.items()]
)
def test_sft_trainer_logs_what_one_process_logs(launched, case, mode):
    out = launched(f"trl/{case}").out
    # fp32 rtol 1e-5: FSDP2's (and cp's, tp's) reduction order. Padding-free rows carry no attention
    # mask: the Trainer's non-padding count then takes their EOS tokens (the pad token) for padding,
    # the padded reference's mask does not, so that count is compared between padded runs only;
    # so is total_flos (it counts positions, padding included).
    skip = ("num_input_tokens_seen",) if mode == "padding_free" else ()
    assert_same_log(out, launched("trl/padded").out, rtol=1e-5, skip=skip, flos=mode != "padding_free")


@runs("trl/lora-reference", "trl/lora-cp2")
def test_sft_trainer_with_lora_logs_what_one_process_logs(launched):
    # fp32 rtol 1e-5: as above.
    assert_same_log(launched("trl/lora-cp2").out, launched("trl/lora-reference").out, rtol=1e-5)


@runs("trl/packing-reference", "trl/packing")
def test_sft_trainer_packing_logs_what_one_process_computing_each_document_alone_logs(launched):
    # fp32 rtol 1e-5: FSDP2's reduction order. total_flos not compared: Transformers sums the
    # ranks' estimates in float32, which rounds these rows' counts (by 16 in 1e9 here; stock dp).
    assert_same_log(launched("trl/packing").out, launched("trl/packing-reference").out, rtol=1e-5, flos=False)


def test_trl_sft_cli_under_cp_logs_what_one_process_logs(tmp_path):
    """TRL's own `trl sft` (its script, SFTConfig's defaults: Transformers' gradient checkpointing,
    the prompt masked from the loss, the model loaded by the trainer from its folder), unchanged:
    `--accelerate_config` with the cp 2 YAML against the same command without it. The checkpoint's
    log history compared: loss, grad norm, entropy, mean_token_accuracy, num_tokens."""
    model, data = saved_tiny_model(tmp_path / "model"), tmp_path / "data"
    data.mkdir()
    shutil.copy(RECIPES / "data" / "sft_tiny.jsonl", data / "train.jsonl")  # prompt and completion
    single, cp2, output = single_and_cp2(tmp_path, "sft", four_sgd_steps(model, data), step=4)
    assert output.count("prepared by qwen35_accel") == 1 and "cp=2" in output, output[-3000:]
    logged = log_history(single)
    losses = [e["loss"] for e in logged if "loss" in e]
    assert len(losses) == 4 and losses[-1] < losses[0] and any(e.get("mean_token_accuracy", 0) > 0 for e in logged), logged
    # fp32 rtol 1e-5: the reduction order of cp's per-chunk partial gradients (as the script's runs above).
    assert_same_log_history(cp2, single, rtol=1e-5, atol=1e-6)
