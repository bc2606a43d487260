from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from qwen35_accel.model.detect import is_dense_qwen35, qwen35_parts
from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_vlm


def test_dense_qwen35_causal_lm_and_vlm_are_detected():
    assert is_dense_qwen35(build_tiny_causal_lm())
    assert is_dense_qwen35(build_tiny_vlm())
    assert is_dense_qwen35(build_tiny_vlm().model.language_model)


def test_other_models_are_not_detected():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert not is_dense_qwen35(llama)
    moe = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=8))
    assert not is_dense_qwen35(moe)
    with pytest.raises(TypeError, match=r"got .*LlamaForCausalLM"):
        qwen35_parts(llama)


def test_parts_of_vlm_point_at_the_language_model_and_vision_blocks():
    model = build_tiny_vlm()
    parts = qwen35_parts(model)
    assert parts.text_model is model.model.language_model
    assert parts.lm_head is model.lm_head
    assert len(parts.vision_blocks) == 2 and parts.layer_types == ("linear_attention", "linear_attention", "full_attention")
