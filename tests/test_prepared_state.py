"""One prepared state: what `PARALLELIZER.apply` made is in the model's one `ModelState`, which every
reader asks (the step's CP context, evaluation, TRL's fused head, the loss), and no other private
attribute of the package's is left on the model."""

from __future__ import annotations

import pytest

from _dist import run_world

pytestmark = pytest.mark.multiprocess


def _state_worker(rank: int, world: int) -> None:
    from peft import LoraConfig, get_peft_model

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.model.detect import unwrap_qwen35
    from qwen35_accel.model.state import STATE_ATTR, find_state, state_of
    from qwen35_accel.parallel.context_parallel.model import context_parallel_mesh, context_parallel_paused
    from qwen35_accel.parallel.prepared import prepared_state
    from qwen35_accel.settings import PluginSettings
    from qwen35_accel.testing.tiny import build_tiny_causal_lm
    from test_tensor_parallel import mesh_for

    model = get_peft_model(build_tiny_causal_lm(seed=0), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    PARALLELIZER.apply(
        model, mesh_for(world, 1, 2, 2), activation_checkpointing=True, activation_offload=True, vocab_parallel_lm_head=True,
    )
    base = unwrap_qwen35(model)
    state = find_state(model)
    assert state is not None and state is state_of(base) and state is model.__dict__[STATE_ATTR]  # one object, shared
    assert prepared_state(model) is state.preparation and state.preparation.base is base
    assert state.cp_mesh is not None and state.cp_mesh.size() == 2 and context_parallel_mesh(base) is state.cp_mesh
    assert state.vocab_group is not None and state.activation_offload is not None and state.tiled_loss in ("recompute", "hold")
    # Nothing else of ours on the model objects but the record every FSDP2 unit made here carries (a
    # per-module marker, as a split module's tp group is): the state is the one place readers ask.
    for holder in (model, base):
        ours = sorted(k for k in vars(holder) if k.startswith("_qwen35") and k != "_qwen35_fsdp_unit")
        assert ours == [STATE_ATTR], (type(holder).__name__, ours)
    with context_parallel_paused(model) as paused:
        assert paused and state.cp_paused and context_parallel_mesh(base) is None
    assert not state.cp_paused and context_parallel_mesh(base) is state.cp_mesh
    # The configuration it ran with, whole: a custom loop's options under the plugin's defaults; the sizes.
    prep = state.preparation
    assert prep.source == "apply" and prep.settings == PluginSettings(parallel=prep.options) and prep.options.vocab_parallel_lm_head
    assert prep.sizes == {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2, "ep": 1}
    # An integration passes the one configuration (read from its environment) and says who it is.
    settings = PluginSettings.from_env({"QWEN35_ACCEL_CP_METRICS_PER_CHUNK": "1", "QWEN35_ACCEL_TILED_LOSS": "hold"})
    other = build_tiny_causal_lm(seed=0)
    with pytest.raises(TypeError, match="not both"):
        PARALLELIZER.apply(other, mesh_for(world, 2, 2, 1), options=settings.parallel, settings=settings)
    with pytest.raises(ValueError, match=r"source='trainer'; expected one of \('apply', 'accelerate', 'distributed_config'\)"):
        PARALLELIZER.apply(other, mesh_for(world, 2, 2, 1), settings=settings, source="trainer")
    PARALLELIZER.apply(other, mesh_for(world, 2, 2, 1), settings=settings.with_parallel(activation_checkpointing=True), source="accelerate")
    prep = prepared_state(other)
    assert prep.source == "accelerate" and prep.settings.cp_metrics_per_chunk and prep.options.tiled_loss == "hold"
    assert prep.options.activation_checkpointing and state_of(other).tiled_loss == "hold"
    assert prep.sizes == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1, "ep": 1}


def test_what_apply_made_is_in_one_state_shared_through_a_peft_wrapper():
    run_world(_state_worker, 4)
