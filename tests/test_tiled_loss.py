"""The tiled training loss (`install_tiled_loss`, on by default in `PARALLELIZER.apply`) equals
the unmodified Transformers model's loss and gradients, returns no logits in training, keeps
Transformers' logits elsewhere, and saves nothing of size tokens × vocab for backward.

Under FSDP2, CP, TP (vocab-parallel lm_head), LoRA, activation checkpointing and packed rows
the tiled loss is what the parity tests of those features compute (tests/test_fsdp_parity.py,
test_cp_model.py, test_tensor_parallel.py, test_lora.py, test_activation_checkpointing.py,
test_packing.py), since `PARALLELIZER.apply` installs it by default.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from _parity import assert_close, assert_grads_match
from qwen35_accel.parallel.tiled_loss import install_tiled_loss, uses_tiled_loss
from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_vlm, mixed_vlm_batch, random_batch


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    batch = random_batch(2, 24, vocab, seed=4)
    batch["labels"][0, :7] = -100  # a masked prompt
    return batch


@pytest.mark.parametrize("num_items_in_batch", [None, 29], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_tiled_loss_equals_transformers_loss_and_gradients(tie, num_items_in_batch):
    reference = build_tiny_causal_lm(seed=0, tie_word_embeddings=tie)
    model = build_tiny_causal_lm(seed=0, tie_word_embeddings=tie)
    assert install_tiled_loss(model, tile=8) and uses_tiled_loss(model)
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
    setattr(model, "_qwen35_tiled_loss", False)  # turned off: Transformers' path in training too
    assert model(**batch).logits is not None


def _saved_for_backward(model, batch) -> tuple[int, int]:
    """(bytes of the distinct storages the loss's graph saves, the largest saved tensor's numel),
    parameters excluded (alive anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    largest = 0

    def pack(t):
        nonlocal largest
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
            largest = max(largest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss
    return sum(storages.values()), largest


def test_nothing_of_size_tokens_times_vocab_is_saved_for_backward():
    vocab = 4096  # wide enough that the logits outweigh the tiny decoder's activations
    reference = build_tiny_causal_lm(seed=0, vocab_size=vocab)
    model = build_tiny_causal_lm(seed=0, vocab_size=vocab)
    install_tiled_loss(model, tile=8)
    batch = random_batch(2, 128, vocab, seed=4)
    tokens, hidden = batch["input_ids"].numel(), model.config.hidden_size
    tiled_bytes, tiled_largest = _saved_for_backward(model, batch)
    transformers_bytes, transformers_largest = _saved_for_backward(reference, batch)
    assert transformers_largest >= tokens * vocab
    assert tiled_largest <= max(tokens, vocab) * hidden, tiled_largest  # hidden states, weight-sized gradients
    # Transformers (fp32) keeps one fp32 [tokens, vocab] for backward (log_softmax's output); the
    # tiled loss keeps the fp32 gradients of the hidden states and the lm_head weight instead.
    loss_path = (tokens + vocab) * hidden * 4
    assert transformers_bytes - tokens * vocab * 4 >= tiled_bytes - loss_path, (tiled_bytes, transformers_bytes)
