"""The tiled training loss (`install_tiled_loss`, on by default in `PARALLELIZER.apply`) equals
the unmodified Transformers model's loss and gradients in both modes (recompute, hold),
returns no logits in training, keeps Transformers' logits elsewhere, and saves nothing of
size tokens × vocab for backward (recompute: nothing of size vocab × hidden either).

Under FSDP2, CP, TP (vocab-parallel lm_head), LoRA, activation checkpointing and packed rows
the default mode (recompute) is what the parity tests of those features compute
(tests/test_fsdp_parity.py, test_cp_model.py, test_tensor_parallel.py, test_lora.py,
test_activation_checkpointing.py, test_packing.py), since `PARALLELIZER.apply` installs it
by default; here both modes run in one process, on packed rows with checkpointing, and in
one world of 2 under cp 2 with checkpointing and tp 2 with a vocab-parallel lm_head.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from _dist import run_world
from _parity import assert_close, assert_grads_match, hf_name
from qwen35_accel.model.state import state_of
from qwen35_accel.parallel.tiled_head import LOSS_MODES
from qwen35_accel.parallel.tiled_loss import install_tiled_loss, tiled_loss_choice, tiled_loss_mode, uses_tiled_loss
from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_vlm, mixed_vlm_batch, random_batch


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    batch = random_batch(2, 24, vocab, seed=4)
    batch["labels"][0, :7] = -100  # a masked prompt
    return batch


@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("num_items_in_batch", [None, 29], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_tiled_loss_equals_transformers_loss_and_gradients(tie, num_items_in_batch, mode):
    reference = build_tiny_causal_lm(seed=0, tie_word_embeddings=tie)
    model = build_tiny_causal_lm(seed=0, tie_word_embeddings=tie)
    assert install_tiled_loss(model, tile=8, mode=mode) and uses_tiled_loss(model) and tiled_loss_mode(model) == mode
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and isinstance(model, hf.Qwen3_5ForCausalLM)
    batch = _batch(model.config.vocab_size)
    kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": torch.tensor(num_items_in_batch)}
    want = reference(**batch, **kwargs)
    got = model(**batch, **kwargs)
    assert got.logits is None and want.logits is not None
    assert_close(got.loss, want.loss, "loss")
    want.loss.backward()
    got.loss.backward()
    assert_grads_match(model, reference)


@pytest.mark.parametrize("media", [["image", "video"], ["image", None]], ids=["image-video", "image-text"])
def test_vlm_tiled_loss_equals_transformers_loss_and_gradients(media):
    """The VLM takes the same loss after its vision tower and mRoPE: the loss and every
    gradient (the tower's included) equal Transformers', and the output keeps the VLM's fields."""
    reference = build_tiny_vlm(seed=0)
    model = build_tiny_vlm(seed=0)
    assert install_tiled_loss(model, tile=8) and uses_tiled_loss(model)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    batch = mixed_vlm_batch(model.config, media, 24, seed=5)
    batch["labels"][0, :5] = -100
    want, got = reference(**batch), model(**batch)
    assert got.logits is None and type(got) is type(want)
    assert (got.image_outputs is None) == (want.image_outputs is None), "image_outputs"
    assert_close(got.loss, want.loss, "loss")
    want.loss.backward()
    got.loss.backward()
    assert_grads_match(model, reference)
    with torch.no_grad():  # evaluation keeps Transformers' logits
        assert torch.equal(model(**batch).logits, reference(**batch).logits)


def test_forwards_that_are_not_training_steps_keep_transformers_logits():
    reference = build_tiny_causal_lm(seed=0)
    model = build_tiny_causal_lm(seed=0)
    install_tiled_loss(model)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():  # evaluation: loss and logits
        got, want = model(**batch), reference(**batch)
        assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    assert torch.equal(model(**unlabelled).logits, reference(**unlabelled).logits)
    assert model(**unlabelled, logits_to_keep=1).logits.shape[1] == 1
    assert isinstance(model(**batch, return_dict=False), tuple)
    state_of(model).tiled_loss = None  # turned off: Transformers' path in training too
    assert model(**batch).logits is not None


def _saved_for_backward(model, batch) -> tuple[int, int, int]:
    """Of the distinct storages the graph saves for backward (parameters excluded, alive
    anyway): (all bytes, the bytes saved once the decoder has returned: the loss path, the
    largest tensor saved there in elements)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, tuple[int, bool]] = {}
    in_loss = [False]
    largest = 0

    def pack(t):
        nonlocal largest
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = (storage.nbytes(), in_loss[0])
            largest = max(largest, t.numel()) if in_loss[0] else largest
        return t

    hook = model.model.register_forward_hook(lambda *_: in_loss.__setitem__(0, True))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss
    hook.remove()
    return sum(n for n, _ in storages.values()), sum(n for n, loss in storages.values() if loss), largest


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_nothing_of_size_tokens_times_vocab_is_saved_for_backward(mode):
    vocab = 4096  # wide enough that the logits outweigh the tiny decoder's activations
    reference = build_tiny_causal_lm(seed=0, vocab_size=vocab)
    model = build_tiny_causal_lm(seed=0, vocab_size=vocab)
    install_tiled_loss(model, tile=8, mode=mode)
    batch = random_batch(2, 128, vocab, seed=4)
    tokens, hidden = batch["input_ids"].numel(), model.config.hidden_size
    tiled_all, tiled_loss, tiled_largest = _saved_for_backward(model, batch)
    transformers_all, transformers_loss, transformers_largest = _saved_for_backward(reference, batch)
    # Transformers (fp32) keeps one fp32 [tokens, vocab] for backward (log_softmax's output).
    assert transformers_largest >= tokens * vocab and transformers_loss >= tokens * vocab * 4
    if mode == "recompute":  # the labelled hidden states, the targets, a log-sum-exp and the mask per token
        assert tiled_largest <= tokens * hidden, tiled_largest
        assert tiled_loss <= tokens * (hidden * 4 + 8 + 4 + 1), tiled_loss
    else:  # the fp32 gradients of the hidden states and the lm_head weight, and the mask
        assert tiled_largest == vocab * hidden, tiled_largest
        assert tiled_loss <= (tokens + vocab) * hidden * 4 + tokens, tiled_loss
    assert tiled_all - tiled_loss == transformers_all - transformers_loss  # the decoder keeps the same


def test_modes_are_named_by_the_setting_and_the_parallelizer_alike():
    assert [tiled_loss_choice(v) for v in (True, False, "recompute", "hold", "off")] == ["recompute", "off", "recompute", "hold", "off"]
    with pytest.raises(ValueError, match=r"tiled_loss='keep': expected one of \['off', 'recompute', 'hold'\]"):
        tiled_loss_choice("keep")
    with pytest.raises(ValueError, match="mode 'off' is not one of"):
        install_tiled_loss(build_tiny_causal_lm(seed=0), mode="off")
    assert tiled_loss_mode(build_tiny_causal_lm(seed=0)) == "off"


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_tiled_loss_on_packed_rows_with_checkpointing_equals_each_document_alone(mode):
    from _parity import documents_alone
    from test_packing import LENGTHS, _models

    from qwen35_accel.parallel.activation_checkpointing import apply_activation_checkpointing
    from qwen35_accel.testing.tiny import packed_documents

    reference, model = _models()
    install_tiled_loss(model, tile=16, mode=mode)
    apply_activation_checkpointing(model.model.layers)
    batch, documents = packed_documents(LENGTHS, reference.config.vocab_size, seed=1)
    out = model(**batch)
    _, want_loss = documents_alone(reference, documents)
    assert out.logits is None
    assert_close(out.loss, want_loss, "loss")
    out.loss.backward()
    want_loss.backward()
    assert assert_grads_match(model, reference) == sum(1 for _ in reference.parameters())


def _modes_under_parallelism_worker(rank: int, world: int) -> None:
    """Both modes, each on a fresh model: cp 2 with activation checkpointing, then tp 2 with a
    vocab-parallel lm_head, on rows with right padding (labels -100); loss and every
    gradient equal the single-process reference's."""
    from test_cp_model import _padded_batch, cp_mesh
    from test_tensor_parallel import mesh_for

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel

    reference = build_tiny_causal_lm(seed=0)
    batch = _padded_batch(2, 32, reference.config.vocab_size, seed=7)
    want = reference(**batch).loss
    want.backward()
    ref = dict(reference.named_parameters())
    for mode in LOSS_MODES:
        for layout in ("cp2-ac", "tp2-vocab-parallel"):
            model = build_tiny_causal_lm(seed=0)
            if layout == "cp2-ac":
                mesh = cp_mesh(world, world)
                PARALLELIZER.apply(model, mesh, activation_checkpointing=True, tiled_loss=mode)
                local = shard_batch(batch, mesh["cp"])
            else:
                PARALLELIZER.apply(model, mesh_for(world, 1, 1, world), vocab_parallel_lm_head=True, tiled_loss=mode)
                local = batch
            assert tiled_loss_mode(model) == mode
            out = model(**local)
            out.loss.backward()
            assert out.logits is None
            assert_close(out.loss.detach(), want.detach(), f"{mode} {layout} loss")
            if layout == "cp2-ac":
                assert assert_grads_match(model, reference) == len(ref)
            else:
                for name, p in model.named_parameters():
                    assert_close(gather_tensor_parallel(model, name, p.grad), ref[hf_name(name)].grad, f"{mode} {layout} grad of {name}")


@pytest.mark.multiprocess
def test_both_modes_under_cp2_with_checkpointing_and_vocab_parallel_tp2_equal_single_process():
    run_world(_modes_under_parallelism_worker, 2)
