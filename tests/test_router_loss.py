"""The MoE router's load-balancing loss counted once per step through the plain Trainer (issue 57).

The objective (docs/moe.md, "The router's loss in a step"): the cross entropy over the global
batch's labelled tokens plus `router_aux_loss_coef` times the mean of the step's router losses, one
per data-parallel replica and micro-batch. In one process with gradient accumulation M, stock
Transformers adds `coef × aux` once per micro-batch (M times the mean); the plugin's
`Trainer.compute_loss` point adds `coef × aux / M`, which stock computes with the coefficient `coef /
M`: that stock run is the unmodified oracle here, and the oracle the launch tests' one-process
accumulation references stand on (tests/test_moe_launch.py). The world-size factor is checked in
those launches (dp 2, cp 2, ep 2, dp 2 x cp 2).
"""

from __future__ import annotations

import pytest
import torch

STEPS, ROWS, LENGTH, COEF = 2, 4, 24, 0.05


def _train(tmp_path, coefficient: float, accumulation: int, stock: bool, monkeypatch, family: str = "moe"
           ) -> tuple[list[dict], dict]:
    """`STEPS` SGD steps of the tiny MoE (`family`: "moe", "vlm" its VLM class, "next" Qwen3-Next; router's
    loss on at `coefficient`)
    through an unchanged `Trainer`, `ROWS` text rows a step in `accumulation` micro-batches; with
    `stock`, Transformers' own `compute_loss`. Returns the log history and the weights."""
    from transformers import Trainer, TrainingArguments

    from qwen35_accel.integrations import plugin
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, build_tiny_moe_vlm, build_tiny_next_causal_lm

    plugin.install()
    patched = Trainer.compute_loss
    assert getattr(patched, "__qwen35_accel_original__", None) is not None, "the plugin's compute_loss point is not installed"
    if stock:
        monkeypatch.setattr(Trainer, "compute_loss", patched.__qwen35_accel_original__)
    build = {"moe": build_tiny_moe_causal_lm, "vlm": build_tiny_moe_vlm, "next": build_tiny_next_causal_lm}[family]
    model = build(seed=0, output_router_logits=True, router_aux_loss_coef=coefficient)
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.get_text_config().vocab_size - 8  # below the VLM's image and video tokens
    ids = torch.randint(0, vocab, (STEPS * ROWS, LENGTH), generator=generator)
    labels = ids.clone()
    labels[:, : LENGTH // 3] = -100  # a prompt: rows differ in nothing else, the count is global
    rows = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
    args = TrainingArguments(
        output_dir=str(tmp_path / ("stock" if stock else "plugin")), per_device_train_batch_size=ROWS // accumulation,
        gradient_accumulation_steps=accumulation, max_steps=STEPS, optim="sgd", learning_rate=0.3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", seed=0, use_cpu=True,
        dataloader_drop_last=True, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    if stock:
        monkeypatch.setattr(Trainer, "compute_loss", patched)
    return [e for e in trainer.state.log_history if "loss" in e], {k: v.detach().clone() for k, v in model.named_parameters()}


def _assert_same(got: tuple[list[dict], dict], want: tuple[list[dict], dict]) -> None:
    (got_log, got_weights), (want_log, want_weights) = got, want
    assert len(got_log) == len(want_log) == STEPS
    for g, w in zip(got_log, want_log):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=0, msg=f"step {w['step']} {key}")
    for name, weight in want_weights.items():  # SGD: a weight differs as much as its summed gradients
        torch.testing.assert_close(got_weights[name], weight, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("family", ["moe", "next"], ids=["qwen3_5_moe", "qwen3_next"])
def test_accumulated_micro_batches_add_the_routers_loss_once_per_step(tmp_path, monkeypatch, family):
    """One process, 2 micro-batches: the plugin's step equals stock's at coef / 2 (logged loss, grad
    norm, every weight after SGD, the routers included), and differs from stock's at coef (the router
    term twice: the routers' weights apart by far more than the tolerance). Qwen3-Next's forward adds
    the same term."""
    plugin = _train(tmp_path / "a", COEF, 2, stock=False, monkeypatch=monkeypatch, family=family)
    _assert_same(plugin, _train(tmp_path / "b", COEF / 2, 2, stock=True, monkeypatch=monkeypatch, family=family))
    twice = _train(tmp_path / "c", COEF, 2, stock=True, monkeypatch=monkeypatch, family=family)
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(twice[1][router], plugin[1][router], rtol=1e-4, atol=0)


def test_without_accumulation_one_process_is_stock(tmp_path, monkeypatch):
    """One process, one micro-batch a step: nothing to correct, the plugin's step is stock's bitwise."""
    plugin = _train(tmp_path / "a", COEF, 1, stock=False, monkeypatch=monkeypatch)
    stock = _train(tmp_path / "b", COEF, 1, stock=True, monkeypatch=monkeypatch)
    assert [(e["loss"], e["grad_norm"]) for e in plugin[0]] == [(e["loss"], e["grad_norm"]) for e in stock[0]]
    assert all(torch.equal(plugin[1][k], v) for k, v in stock[1].items())


def test_the_vlm_class_takes_no_loss_kwargs_and_stays_stock(tmp_path, monkeypatch):
    """`Qwen3_5MoeForConditionalGeneration` declares `accepts_loss_kwargs = False`: the Trainer neither
    multiplies its loss nor leaves accumulation to it (it divides the whole loss by the micro-batches),
    so stock already counts its router term once per step; the point changes nothing there (2
    micro-batches, stock at the same coefficient, bitwise)."""
    plugin = _train(tmp_path / "a", COEF, 2, stock=False, monkeypatch=monkeypatch, family="vlm")
    stock = _train(tmp_path / "b", COEF, 2, stock=True, monkeypatch=monkeypatch, family="vlm")
    assert [(e["loss"], e["grad_norm"]) for e in plugin[0]] == [(e["loss"], e["grad_norm"]) for e in stock[0]]
    assert all(torch.equal(plugin[1][k], v) for k, v in stock[1].items())
