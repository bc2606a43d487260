"""Liger's fused linear cross-entropy (the Trainer's `use_liger_kernel=True`) on a Qwen3.5 model: Liger sets
its own forward on the model instance, which then computes the loss instead of the class's (the plugin's
tiled loss among them); the prepared line says so. Runs where Liger is installed (the `kernels-cpu` extra:
CI's kernel step); skipped elsewhere."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason='liger-kernel not installed (pip install -e ".[kernels-cpu]")'),
]


def test_the_prepared_line_names_ligers_loss_where_use_liger_kernel_replaced_the_forward():
    from transformers.integrations.liger import apply_liger_kernel

    from qwen35_accel.integrations.prepared_line import loss_in_effect
    from qwen35_accel.parallel.tiled_loss import install_tiled_loss
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    plain = build_tiny_causal_lm(seed=0)
    install_tiled_loss(plain, mode="recompute")
    assert loss_in_effect(plain).startswith("tiled, recompute")
    model = build_tiny_causal_lm(seed=0)
    apply_liger_kernel(model, None)  # what the Trainer does with use_liger_kernel=True, before Accelerate prepares
    install_tiled_loss(model, mode="recompute")  # the plugin's preparation, after it
    assert loss_in_effect(model) == (
        "Liger's fused linear cross-entropy (use_liger_kernel): the forward liger_kernel.transformers.model.qwen3_5."
        "lce_forward set on the model computes it; the tiled loss does not run"
    )
