"""The plugin's messages tell the truth: settings, Accelerate's refusals, checkpointing.

Each test fails if the old message (or the old behaviour behind it) returns.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch

from _dist import run_world
from _parity import assert_close, assert_grads_match


def test_an_unknown_setting_warns_once_and_raises_only_where_a_qwen35_model_is_prepared():
    from qwen35_accel import settings

    environ = {"QWEN35_ACCEL_FOO_UNKNOWN_ONCE": "1", "QWEN35_ACCEL_FSDP2_FORWARD_PREFETCH_DEPTH": "2"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = settings.PluginSettings.from_env(environ)  # stock paths (every model, `env`) read it like this
        second = settings.PluginSettings.from_env(environ)
    assert first == second and first.parallel.fsdp2_forward_prefetch_depth == 2
    unknown = [w for w in caught if "QWEN35_ACCEL_FOO_UNKNOWN_ONCE" in str(w.message)]
    assert len(unknown) == 1, [str(w.message) for w in caught]  # once per process, not per read
    assert "qwen35_accel reads [" in str(unknown[0].message) and "QWEN35_ACCEL_CPU_FSDP" in str(unknown[0].message)
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['QWEN35_ACCEL_FOO_UNKNOWN_ONCE'\].*correct or unset it"):
        settings.PluginSettings.from_env(environ, strict=True)  # prepare_qwen35_fsdp2 reads it like this


def test_replicate_only_data_parallelism_with_cp_is_refused_with_the_layouts_that_work(monkeypatch):
    from accelerate import Accelerator

    import qwen35_accel

    qwen35_accel.install()
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    with pytest.raises(ValueError) as raised:
        Accelerator()  # what `accelerate launch` builds from the YAML's parallelism_config
    message = str(raised.value)
    assert "dp_replicate_size=2, dp_shard_size=1, cp_size=2, tp_size=1" in message
    assert "dp_replicate_size: 1, dp_shard_size: 2 (FSDP2" in message
    assert "dp_replicate_size: 2, dp_shard_size: 2, cp_size: 1 (HSDP)" in message
    # Accelerate's own advice asks for dp_replicate_size == 1 to compose HSDP: never shown.
    assert "dp_replicate_size == 1 and dp_shard_size > 1 to compose HSDP" not in message
    assert raised.value.__cause__ is None and raised.value.__context__ is None


def test_replicate_only_data_parallelism_with_tp_is_refused_first_only_where_accelerate_refuses_it(monkeypatch):
    """Accelerate 1.15 refuses dp_replicate > 1, dp_shard 1 with tp > 1 in ParallelismConfig (then so do we,
    first, with the layouts that work); 1.16 accepts it (DDP x TP for other models; under FSDP its own
    check refuses it with sound advice), so it is left to Accelerate there."""
    from accelerate import ParallelismConfig

    from qwen35_accel.integrations.parallelism_layouts import accelerate_refuses_replicate_only_tp, replicate_only_refusal

    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    if accelerate_refuses_replicate_only_tp():
        with pytest.raises(ValueError, match="cannot be used with pure data parallelism"):
            ParallelismConfig(dp_replicate_size=4, tp_size=2)
        message = str(replicate_only_refusal())
        assert "on the same 8 processes" in message
        assert "dp_replicate_size: 2, dp_shard_size: 2 (HSDP)" in message
        assert "dp_replicate_size: 4, dp_shard_size: 2, tp_size: 1 (HSDP)" in message
    else:
        ParallelismConfig(dp_replicate_size=4, tp_size=2)  # accepted: stock behaviour stays stock
        assert replicate_only_refusal() is None
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    assert replicate_only_refusal() is None  # HSDP x tp: Accelerate's to judge


def test_an_error_of_accelerates_own_init_says_the_plugin_only_called_it():
    from accelerate import Accelerator

    import qwen35_accel

    qwen35_accel.install()
    with pytest.raises(ValueError, match="Unknown mixed_precision mode: fp7") as raised:
        Accelerator(mixed_precision="fp7")
    notes = getattr(raised.value, "__notes__", [])
    assert any("raised by Accelerate's own Accelerator.__init__" in note for note in notes), notes


def _checkpointing_worker(rank: int, world: int, ours: bool, cp: int) -> None:
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=ours),
        parallelism_config=ParallelismConfig(dp_shard_size=world // cp, cp_size=cp),
    )
    reference = build_tiny_causal_lm(seed=0)
    model = build_tiny_causal_lm(seed=0)
    # What TrainingArguments(gradient_checkpointing=True) does (TRL's default). Reentrant (TRL's choice
    # with PEFT) where ours is on as well: nested inside ours it recomputes the layer a second time
    # (3 forwards per step), while a non-reentrant one nested in ours costs nothing more (torch
    # handles nested non-reentrant checkpoints), so only the reentrant form can show a double.
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": ours})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        model, optimizer = accelerator.prepare(model, optimizer)
    if rank == 0:
        line = next(line for line in stderr.getvalue().splitlines() if "prepared by qwen35_accel" in line)
        assert "activation checkpointing=" not in line, line  # the old line said "=False" under Transformers' own
        assert "loss: tiled" in line, line  # the default training loss, named
        assert "GatedDeltaNet kernels: torch (CPU run" in line, line  # which kernels run, said
        if ours:
            assert "activation checkpointing: qwen35_accel's (each decoder layer; Transformers' gradient " \
                   "checkpointing was on too and is turned off" in line, line
        else:
            assert "activation checkpointing: Transformers' gradient checkpointing (3 of 3 decoder layers)" in line, line

    # Calls of a decoder layer's MLP per training step: 1 without checkpointing, 2 when the layer
    # is checkpointed once (forward + recompute), 3 when checkpointed twice. A pre-hook: a
    # non-reentrant recomputation stops as soon as the last saved tensor is back, before the
    # layer's last module finishes, so its forward hooks would not fire.
    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    dp = world // cp
    dp_rank = rank // cp
    batch = random_batch(2 * dp, 16, reference.config.vocab_size, seed=3)
    shift = torch.cat([batch["labels"][:, 1:], torch.full((2 * dp, 1), -100)], dim=1)
    num_items = (shift != -100).sum()
    local = {"input_ids": batch["input_ids"], "labels": batch["labels"], "shift_labels": shift,
             "position_ids": torch.arange(16).expand(2 * dp, 16)}
    local = {k: v[2 * dp_rank : 2 * dp_rank + 2].clone() for k, v in local.items()}
    buffers = list(local.values())
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers)):
        loss = model(**local, num_items_in_batch=num_items).loss * accelerator.num_processes
        accelerator.backward(loss)
    assert len(calls) == 2, f"layer 0 ran {len(calls)} times in a step (2 = checkpointed once)"

    ref_loss = reference(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    ref_loss.backward()
    reported = loss.detach().clone()
    torch.distributed.all_reduce(reported, op=torch.distributed.ReduceOp.AVG)  # what the Trainer logs
    assert_close(reported, ref_loss.detach(), "loss")
    # fp32 rtol 1e-5 / atol 1e-6: FSDP2 (and CP) sum the gradients in another order than one process.
    assert_grads_match(model, reference, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "ours,cp", [(True, 1), (False, 2)], ids=["ours-and-transformers-fsdp2", "transformers-only-cp2"]
)
def test_a_decoder_layer_is_checkpointed_once_and_the_prepared_line_says_by_whom(ours, cp):
    """Transformers' gradient checkpointing on (TRL's default) with and without the FSDP
    plugin's activation checkpointing: ours wins and Transformers' flags go off (a layer is
    never checkpointed twice), or Transformers' runs inside our units (also under CP);
    loss and gradients stay the single-process model's."""
    run_world(_checkpointing_worker, 2, ours, cp)


def _different_settings_worker(rank: int, world: int) -> None:
    import os

    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    if rank == 1:  # as if one node's launcher had it set
        os.environ["QWEN35_ACCEL_TILED_LOSS"] = "off"
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    with pytest.raises(ValueError, match=r"the ranks read different qwen35_accel settings: "
                                         r"\{'QWEN35_ACCEL_TILED_LOSS': \{0: 'recompute', 1: 'off'\}\}"):
        accelerator.prepare(build_tiny_causal_lm(seed=0))


@pytest.mark.multiprocess
def test_ranks_that_read_different_settings_are_refused_on_every_rank():
    """Settings choose collectives (the loss, the CP exchange, prefetching): ranks whose
    environments differ stop together with the values per rank, never hang."""
    run_world(_different_settings_worker, 2)
