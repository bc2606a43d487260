"""Inputs the parallelizer cannot handle raise clear errors before touching the model."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

from _dist import run_world

pytestmark = pytest.mark.multiprocess


def _bad_input_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(TypeError, match=r"got transformers\.models\.llama\.modeling_llama\.LlamaForCausalLM.*"):
        PARALLELIZER.apply(llama, flat)
    with pytest.raises(TypeError, match=r"Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration"):
        PARALLELIZER.apply(llama, flat)

    no_shard_dim = init_device_mesh("cpu", (world,), mesh_dim_names=("data",))
    with pytest.raises(ValueError, match=r"no dim named 'dp_shard_cp' \(dims: \['data'\]\)"):
        PARALLELIZER.apply(build_tiny_causal_lm(), no_shard_dim)

    with pytest.raises(ValueError, match=r"frozen_multimodal_sharding='all'; expected one of \('root', 'replicate', 'shard'\)"):
        PARALLELIZER.apply(build_tiny_causal_lm(), flat, frozen_multimodal_sharding="all")

    # Nothing was modified by a refused call: the model is still the plain one.
    model = build_tiny_causal_lm()
    with pytest.raises(ValueError):
        PARALLELIZER.apply(model, no_shard_dim)
    assert "A_log" in model.model.layers[0].linear_attn._parameters

    # Applying twice is refused.
    sharded = PARALLELIZER.apply(build_tiny_causal_lm(), flat)
    with pytest.raises(ValueError, match="already sharded"):
        PARALLELIZER.apply(sharded, flat)


def test_unsupported_models_meshes_and_options_raise_clear_errors():
    run_world(_bad_input_worker, 2)
