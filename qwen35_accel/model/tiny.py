"""Tiny dense Qwen3.5 models built in code (no downloads): `qwen35-accel plan --model tiny`,
the demo, and the tests and benchmarks (through `qwen35_accel.testing.tiny`).

`tiny_text_config` keeps every feature that matters for parallel correctness: GatedDeltaNet
and full-attention layers, GQA in both (value heads > key heads in GatedDeltaNet), partial
rotary, optional tied embeddings. `randomize_for_parity` replaces the Transformers init
where it would hide bugs (see the project's testing notes): weak decay so the recurrent
state carries across the whole sequence, and norm weights away from zero.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf_qwen4
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig


def tiny_text_config(*, tie_word_embeddings: bool = False, num_hidden_layers: int = 3, **overrides: Any) -> Qwen3_5TextConfig:
    """Layers follow Qwen3.5's pattern with interval 3: linear, linear, full, linear, …"""
    kwargs: dict[str, Any] = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 3 == 0 else "linear_attention" for i in range(num_hidden_layers)],
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=4096,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    config = Qwen3_5TextConfig(**kwargs)
    config._attn_implementation = "sdpa"
    return config


def tiny_vlm_config(**text_overrides: Any) -> Qwen3_5Config:
    """A tiny `Qwen3_5ForConditionalGeneration` config (2 vision blocks)."""
    text = tiny_text_config(**text_overrides)
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        in_channels=3,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=text.hidden_size,
        num_position_embeddings=16,
    )
    config = Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=vision,
        image_token_id=text.vocab_size - 1,
        video_token_id=text.vocab_size - 2,
        vision_start_token_id=text.vocab_size - 3,
        vision_end_token_id=text.vocab_size - 4,
        tie_word_embeddings=text.tie_word_embeddings,
    )
    config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    return config


def tiny_moe_text_config(*, num_hidden_layers: int = 3, **overrides: Any) -> Qwen3_5MoeTextConfig:
    """`tiny_text_config`'s shape for the MoE family: 6 experts, top 2, a shared expert."""
    dense = tiny_text_config(num_hidden_layers=num_hidden_layers).to_dict()
    kwargs = {key: dense[key] for key in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim", "layer_types", "tie_word_embeddings", "max_position_embeddings", "pad_token_id")}
    kwargs.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    kwargs.update(overrides)
    config = Qwen3_5MoeTextConfig(**kwargs)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"  # the one-process oracle's experts loop
    return config


def tiny_next_config(*, num_hidden_layers: int = 3, **overrides: Any) -> Qwen3NextConfig:
    """`tiny_moe_text_config`'s shape for Qwen3-Next: 2 GatedDeltaNet layers and a gated attention layer,
    6 experts, top 2, a shared expert (every layer sparse)."""
    moe = tiny_moe_text_config(num_hidden_layers=num_hidden_layers).to_dict()
    kwargs = {key: moe[key] for key in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim", "layer_types", "tie_word_embeddings", "max_position_embeddings", "pad_token_id",
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")}
    kwargs.update(intermediate_size=32, partial_rotary_factor=0.25)
    kwargs.update(overrides)
    config = Qwen3NextConfig(**kwargs)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    return config


def tiny_qwen4_exp_config(*, num_hidden_layers: int = 3, **overrides: Any) -> Qwen4ExpTextConfig:
    """A tiny Qwen4-Exp text config: 2 GatedDeltaNet layers and an indexed-attention layer (QSA: blocks of 4,
    budget 8), 2 hyper-connection streams, n-gram embeddings (trigrams, small prime tables) on layer 0,
    6 experts, top 2, a shared expert."""
    kwargs: dict[str, Any] = dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6,
        num_experts_per_tok=2, layer_types=["linear_attention" if (i + 1) % 3 else "indexed_attention" for i in range(num_hidden_layers)],
        hc_count=2, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=24, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=101, make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4, eos_token_id=1, pad_token_id=0,
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    config = Qwen4ExpTextConfig(**kwargs)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    return config


def tiny_moe_vlm_config(**text_overrides: Any) -> Qwen3_5MoeConfig:
    """`tiny_vlm_config`'s vision tower and tokens around `tiny_moe_text_config`."""
    dense = tiny_vlm_config()
    config = Qwen3_5MoeConfig(
        text_config=tiny_moe_text_config(**text_overrides).to_dict(),
        vision_config=dense.vision_config.to_dict(),
        **{key: getattr(dense, key) for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")},
        tie_word_embeddings=False,
    )
    for sub in (config, config.text_config, config.vision_config):
        sub._attn_implementation = "sdpa"
    config.text_config._experts_implementation = "eager"
    return config


@torch.no_grad()
def randomize_for_parity(model: nn.Module, seed: int) -> nn.Module:
    """Deterministically re-initialise `model` (in place) so parallel bugs show.

    GatedDeltaNet: `A_log = log(U(0.002, 0.05))`, `dt_bias ~ N(0, 0.3)` (weak decay);
    every 1-D parameter (norm weights, biases) gets noise; MoE routers get weights of
    std 0.3 (Transformers starts them at zero: every token would tie), so a token's top-k
    experts are apart by far more than any reduction order moves the logits; the rest keeps
    its init. Works before or after `install_fp32_gate`.
    """
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (hf_moe.Qwen3_5MoeTopKRouter, hf_next.Qwen3NextTopKRouter, hf_qwen4.Qwen4ExpTextTopKRouter)):
            module.weight.copy_((0.3 * torch.randn(module.weight.shape, generator=gen)).to(module.weight.dtype))
        if isinstance(module, (hf.Qwen3_5GatedDeltaNet, hf_moe.Qwen3_5MoeGatedDeltaNet, hf_next.Qwen3NextGatedDeltaNet,
                               hf_qwen4.Qwen4ExpTextGatedDeltaNet)):
            n = module.A_log.numel()
            module.A_log.copy_(torch.empty(n).uniform_(0.002, 0.05, generator=gen).log())
            module.dt_bias.copy_(torch.randn(n, generator=gen) * 0.3)
    for name, p in model.named_parameters():
        if p.dim() == 1 and not name.endswith(("A_log", "dt_bias")):
            p.copy_(p + 0.2 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return model


def _built(model_class: type[nn.Module], config: Any, seed: int, dtype: torch.dtype) -> Any:
    """`model_class(config)` under Transformers' init seeded with `seed`, then
    `randomize_for_parity`, in `dtype`: the same weights for the same seed."""
    torch.manual_seed(seed)
    model = model_class(config)
    randomize_for_parity(model, seed)
    return model.to(dtype)


def build_tiny_causal_lm(seed: int = 0, *, dtype: torch.dtype = torch.float32, **config_overrides: Any) -> hf.Qwen3_5ForCausalLM:
    """Unmodified Transformers `Qwen3_5ForCausalLM`, same weights for the same seed."""
    return _built(hf.Qwen3_5ForCausalLM, tiny_text_config(**config_overrides), seed, dtype)


def build_tiny_vlm(seed: int = 0, *, dtype: torch.dtype = torch.float32, **text_overrides: Any) -> hf.Qwen3_5ForConditionalGeneration:
    """Unmodified Transformers `Qwen3_5ForConditionalGeneration`, same weights per seed."""
    return _built(hf.Qwen3_5ForConditionalGeneration, tiny_vlm_config(**text_overrides), seed, dtype)


def build_tiny_moe_causal_lm(seed: int = 0, *, dtype: torch.dtype = torch.float32, **config_overrides: Any) -> hf_moe.Qwen3_5MoeForCausalLM:
    """Unmodified Transformers `Qwen3_5MoeForCausalLM` (`tiny_moe_text_config`), same weights per seed."""
    return _built(hf_moe.Qwen3_5MoeForCausalLM, tiny_moe_text_config(**config_overrides), seed, dtype)


def build_tiny_moe_vlm(seed: int = 0, *, dtype: torch.dtype = torch.float32, **text_overrides: Any) -> hf_moe.Qwen3_5MoeForConditionalGeneration:
    """Unmodified Transformers `Qwen3_5MoeForConditionalGeneration` (`tiny_moe_vlm_config`), same weights per seed."""
    return _built(hf_moe.Qwen3_5MoeForConditionalGeneration, tiny_moe_vlm_config(**text_overrides), seed, dtype)


def build_tiny_next_causal_lm(seed: int = 0, *, dtype: torch.dtype = torch.float32,
                              **config_overrides: Any) -> hf_next.Qwen3NextForCausalLM:
    """Unmodified Transformers `Qwen3NextForCausalLM` (`tiny_next_config`), same weights per seed."""
    return _built(hf_next.Qwen3NextForCausalLM, tiny_next_config(**config_overrides), seed, dtype)


def build_tiny_qwen4_exp_causal_lm(seed: int = 0, *, dtype: torch.dtype = torch.float32,
                                   **config_overrides: Any) -> hf_qwen4.Qwen4ExpForCausalLM:
    """Unmodified Transformers `Qwen4ExpForCausalLM` (`tiny_qwen4_exp_config`), same weights per seed."""
    return _built(hf_qwen4.Qwen4ExpForCausalLM, tiny_qwen4_exp_config(**config_overrides), seed, dtype)


def build_tiny_sequence_classifier(seed: int = 0, *, num_labels: int = 1, dtype: torch.dtype = torch.float32,
                                   **config_overrides: Any) -> hf.Qwen3_5TextForSequenceClassification:
    """Unmodified Transformers `Qwen3_5TextForSequenceClassification` (a reward model at `num_labels`
    1) on `tiny_text_config` (pad token 0), same weights per seed."""
    return _built(hf.Qwen3_5TextForSequenceClassification, tiny_text_config(num_labels=num_labels, **config_overrides),
                  seed, dtype)


def build_tiny_token_classifier(seed: int = 0, *, num_labels: int = 3, dtype: torch.dtype = torch.float32,
                                **text_overrides: Any) -> hf.Qwen3_5ForTokenClassification:
    """Unmodified Transformers `Qwen3_5ForTokenClassification` on `tiny_vlm_config`, same weights per seed."""
    config = tiny_vlm_config(**text_overrides)
    config.num_labels = num_labels
    config.classifier_dropout = 0.0  # Transformers' default 0.1 draws other masks on every rank
    return _built(hf.Qwen3_5ForTokenClassification, config, seed, dtype)
