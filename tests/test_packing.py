"""Packed rows: every document of a row equals that document run alone through the
unmodified Transformers model, with the forward's default kwargs (`use_cache` left at the
config's True, as a Trainer forward runs)."""

from __future__ import annotations

import pytest
import torch

from _parity import assert_close, documents_alone, eval_logits, hf_name
from qwen35_accel.model.fp32_gate import install_fp32_gate
from qwen35_accel.model.packing import document_layout
from qwen35_accel.testing.tiny import build_tiny_causal_lm, packed_documents

# Long and short documents, one shorter than the conv kernel (4), one of a single token,
# and one longer than the gated delta rule's chunk (64): every case of the conv window
# and of the chunked recurrence at a boundary.
LENGTHS = [70, 24, 3, 1, 40]


def _models(seed: int = 0):
    reference = build_tiny_causal_lm(seed=seed, use_cache=True)  # Qwen3.5's default
    model = build_tiny_causal_lm(seed=seed, use_cache=True)
    install_fp32_gate(model)
    return reference, model


def test_every_document_of_a_packed_row_equals_the_document_alone():
    reference, model = _models()
    batch, documents = packed_documents(LENGTHS, reference.config.vocab_size, seed=1)
    out = model(**batch)
    want_logits, want_loss = documents_alone(reference, documents)
    # fp32 rtol 1e-5: the same kernels on the same tokens, batched with other documents.
    assert_close(out.logits, want_logits, "logits")
    assert_close(out.loss, want_loss, "loss")
    out.loss.backward()
    want_loss.backward()
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, ref[hf_name(name)].grad, f"grad of {name}")


def test_documents_are_grouped_once_per_forward(monkeypatch):
    """Every GatedDeltaNet conv and recurrence of a forward reuses one grouping (its sizes
    cost a host sync)."""
    from qwen35_accel.ops import documents

    calls = []
    original = documents._groups
    monkeypatch.setattr(documents, "_groups", lambda *args: calls.append(args) or original(*args))
    _, model = _models()
    batch, _ = packed_documents(LENGTHS, model.config.vocab_size, seed=1)
    model(**batch).loss.backward()
    layers = sum(1 for t in model.config.layer_types if t == "linear_attention")
    assert layers >= 2 and len(calls) == 1


def test_sharded_documents_first_keys_per_chunk():
    """The first key each local chunk's attention needs: the earliest document start among
    its queries, computed once per forward (one host sync) and shared by the layers."""
    from qwen35_accel.parallel.context_parallel.sharded_documents import shard_documents

    starts = torch.zeros(2, 16, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, [5, 9]] = True  # row 0: documents at 0, 5, 9
    starts[1, 12] = True  # row 1: documents at 0, 12
    # cp 2, rank 1 holds chunks 1 (tokens 4-7) and 2 (tokens 8-11).
    docs = shard_documents(starts, cp=2, rank=1)
    assert docs.index.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # chunk 1: row 0's token 4 is in the document from 0, row 1's from 0 -> 0; chunk 2: row 0
    # from 5 and 9, row 1 from 0 -> 0. Rank 0 (chunks 0 and 3): 0 and min(9, 12) = 9.
    assert docs.first_keys == (0, 0)
    assert shard_documents(starts, cp=2, rank=0).first_keys == (0, 9)
    assert docs.first_keys is docs.first_keys  # cached on the instance


def test_unmodified_transformers_leaks_across_documents_so_the_comparison_can_fail():
    reference, _ = _models()
    batch, documents = packed_documents(LENGTHS, reference.config.vocab_size, seed=1)
    leaked = reference(**batch).logits
    want, _ = documents_alone(reference, documents)
    assert (leaked - want).abs().max() > 1e-2


@pytest.mark.parametrize("form", ["cu_seq_lens", "seq_idx", "both"])
def test_every_accepted_form_gives_the_same_row(form):
    reference, model = _models()
    batch, _ = packed_documents(LENGTHS, reference.config.vocab_size, seed=2)
    want = model(**batch).logits
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = {"input_ids": batch["input_ids"]}
    if form in ("cu_seq_lens", "both"):
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    if form == "seq_idx":
        kwargs["seq_idx"] = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None]
    if form == "both":
        kwargs["position_ids"] = batch["position_ids"]
    assert_close(model(**kwargs).logits, want, f"logits from {form}")


def test_forms_that_disagree_raise_naming_both():
    batch, _ = packed_documents(LENGTHS, 96, seed=3)
    wrong = torch.tensor([0, 70, 95, 138], dtype=torch.int32)
    with pytest.raises(ValueError, match="position_ids and cu_seq_lens_q describe different document boundaries"):
        document_layout(1, 138, position_ids=batch["position_ids"], cu_seq_lens_q=wrong)


@pytest.mark.parametrize(
    "cu,message",
    [([0, 70, 100], r"must start at 0 and end at the number of tokens in the batch \(1 x 138 = 138\)"),
     ([0, 70, 60, 138], "must increase strictly")],
    ids=["short", "decreasing"],
)
def test_bad_cu_seq_lens_raise(cu, message):
    with pytest.raises(ValueError, match=message):
        document_layout(1, 138, cu_seq_lens_q=torch.tensor(cu))


def test_packed_rows_with_padding_or_a_cache_are_refused():
    from transformers import DynamicCache

    _, model = _models()
    batch, _ = packed_documents(LENGTHS, 96, seed=4)
    mask = torch.ones_like(batch["input_ids"])
    mask[:, :5] = 0
    with pytest.raises(ValueError, match="cannot be combined with padding"):
        model(**batch, attention_mask=mask)
    with pytest.raises(NotImplementedError, match="cannot be combined with a cache"):
        model(**batch, cache=DynamicCache(config=model.config))
    # An all-ones mask is no padding: the same logits as without one.
    assert_close(model(**batch, attention_mask=torch.ones_like(mask)).logits, model(**batch).logits, "all-ones mask")


def _parallel_packing_worker(rank: int, world: int, dp: int, tp: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER

    mesh = init_device_mesh("cpu", (1, dp, 1, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    reference, model = _models()
    PARALLELIZER.apply(model, mesh)
    batch, documents = packed_documents(LENGTHS, reference.config.vocab_size, seed=5)  # the same row on every rank
    want_logits, want_loss = documents_alone(reference, documents)
    want_loss.backward()
    for form, inputs in _forms(batch, LENGTHS).items():
        model.zero_grad(set_to_none=True)
        where = f"{form}, dp {dp} x tp {tp}"
        if tp == 1:  # an eval forward's logits, before the training forward (whose tiled loss returns none)
            assert_close(eval_logits(model, inputs), want_logits, f"logits, {where}")
        out = model(**inputs)
        assert_close(out.loss, want_loss, f"loss, {where}")
        out.loss.backward()
        # fp32 rtol 1e-5 / atol 1e-6: FSDP2 averages the ranks' equal gradients, TP sums slices.
        _assert_parallel_grads(model, reference, tp, where)
    dist.barrier()


def _forms(batch: dict[str, torch.Tensor], lengths: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    """The packed batch as `DataCollatorWithFlattening` gives it in its two variants:
    restarting `position_ids`, or `cu_seq_lens_q/k` with `max_length_q/k` only."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    flash = {"input_ids": batch["input_ids"], "labels": batch["labels"], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
             "max_length_q": max(lengths), "max_length_k": max(lengths)}
    return {"position_ids": batch, "cu_seq_lens": flash}


def _assert_parallel_grads(model, reference, tp: int, where: str) -> None:
    """Every gradient (FSDP2-gathered, or TP slices gathered) equals the reference's."""
    from _parity import full
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel

    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = gather_tensor_parallel(model, name, p.grad) if tp > 1 else full(p.grad)
        assert_close(grad, ref[hf_name(name)].grad, f"grad of {name}, {where}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp,tp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)], ids=["fsdp2", "tp2"])
def test_packed_rows_under_fsdp2_and_tensor_parallelism_equal_the_documents_alone(dp, tp):
    from _dist import run_world

    run_world(_parallel_packing_worker, dp * tp, dp, tp)


def test_image_rows_are_not_mistaken_for_packed_rows():
    """Qwen3.5's multimodal rotary positions repeat over an image's tokens and jump after
    it; they are not document boundaries (Transformers reads none from them either)."""
    from qwen35_accel.testing.tiny import build_tiny_vlm, random_vlm_batch

    reference, model = build_tiny_vlm(seed=0), build_tiny_vlm(seed=0)
    install_fp32_gate(model)
    batch = random_vlm_batch(reference.config, 2, 16, seed=0)
    assert_close(model(**batch).loss, reference(**batch).loss, "loss of rows with an image")


# Under CP: 138 tokens padded to 140 (cp 2, chunks of 35) or 144 (cp 4, chunks of 18).
# Documents straddle chunk and rank boundaries; a 3-token document straddles token 54
# (a cp-4 chunk start), single-token documents sit at token 36 and at 72 (a cp-4 chunk
# start), and at cp 2 a chunk starts with the last token of a document.
CP_LENGTHS = [20, 16, 1, 2, 14, 3, 16, 1, 45, 20]


def _cp_packing_worker(rank: int, world: int, dp: int, cp: int, tp: int, rows_per_replica: int, ac: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import gather_sequence, shard_batch

    mesh = init_device_mesh("cpu", (1, dp, cp, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    reference, model = _models()
    PARALLELIZER.apply(model, mesh, activation_checkpointing=ac)
    vocab = reference.config.vocab_size
    # Every row its own documents (the same lengths in another order, so every row's loss
    # has the same number of predictions and the oracle is the mean of the rows' losses).
    count = dp * rows_per_replica
    rows = [packed_documents(CP_LENGTHS[r:] + CP_LENGTHS[:r], vocab, seed=10 + r) for r in range(count)]
    oracle = [documents_alone(reference, docs) for _, docs in rows]
    want_loss = sum(loss for _, loss in oracle) / count
    want_loss.backward()
    mine = range(mesh["dp_shard"].get_local_rank() * rows_per_replica, (mesh["dp_shard"].get_local_rank() + 1) * rows_per_replica)
    batch = {key: torch.cat([rows[r][0][key] for r in mine]) for key in rows[0][0]}
    want_logits = torch.cat([oracle[r][0] for r in mine]).detach()
    seq = batch["input_ids"].shape[1]
    lengths = [d.shape[1] for r in mine for d in rows[r][1]]  # flattened row after row
    forms = _forms(batch, lengths)
    for form, whole in forms.items():
        model.zero_grad(set_to_none=True)
        where = f"{form}, dp {dp} x cp {cp} x tp {tp}"
        if tp == 1:  # an eval forward's logits, before the training forward (whose tiled loss returns none)
            logits = gather_sequence(eval_logits(model, shard_batch(whole, mesh["cp"])), mesh["cp"])[:, :seq]
            assert_close(logits, want_logits, f"logits, {where}")
        out = model(**shard_batch(whole, mesh["cp"]))
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp_shard"].get_group())
        assert_close(loss, want_loss.detach(), f"loss, {where}")
        out.loss.backward()
        # fp32 rtol 1e-5 / atol 1e-6: the chunk summaries fold the recurrence in another
        # order than one pass over each document; FSDP2 averages, TP sums slices.
        _assert_parallel_grads(model, reference, tp, where)
    dist.barrier()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "dp,cp,tp,rows,ac",
    # dp2xcp2 with activation checkpointing: the recomputed layers get the same documents.
    [(1, 2, 1, 1, False), pytest.param(1, 4, 1, 2, False, marks=pytest.mark.slow), pytest.param(2, 2, 1, 1, True, marks=pytest.mark.slow),
     pytest.param(1, 2, 2, 1, False, marks=pytest.mark.slow)],  # world 4: slow
    ids=["cp2", "cp4-two-rows", "dp2xcp2-ac", "cp2xtp2"],
)
def test_packed_rows_under_context_parallelism_equal_the_documents_alone(dp, cp, tp, rows, ac):
    from _dist import run_world

    run_world(_cp_packing_worker, dp * cp * tp, dp, cp, tp, rows, ac)


def test_packed_attention_under_cp_keeps_memory_linear_in_tokens():
    """The SDPA path of packed rows under CP (the one CUDA runs: no recompute checkpoint)
    keeps for backward what grows with the tokens, not with their square: twice the row
    (twice the documents of the same length) keeps at most ~2x the bytes; a [queries, keys]
    document mask over a whole chunk grows with the chunk's square. Its output equals each document alone."""
    import torch.nn.functional as F

    from qwen35_accel.parallel.context_parallel.attention import _sdpa_documents
    from qwen35_accel.parallel.context_parallel.sharded_documents import shard_documents
    from qwen35_accel.parallel.context_parallel.chunks import local_positions
    from qwen35_accel.testing.saved_tensors import saved_storage_bytes

    heads, kv_heads, dim, doc = 4, 2, 4, 8  # the old chunk-wide mask kept 2.64x here
    saved = {}
    for seq in (128, 256):
        g = torch.Generator().manual_seed(seq)
        q_full = torch.randn(1, heads, seq, dim, generator=g)
        k_full, v_full = torch.randn(2, 1, kv_heads, seq, dim, generator=g).unbind(0)
        starts = torch.zeros(1, seq, dtype=torch.bool)
        starts[:, ::doc] = True
        starts[:, 5] = True  # one short document, straddling nothing in particular
        docs = shard_documents(starts, cp=2, rank=1)
        q = q_full[:, :, local_positions(seq, 2, 1)].clone().requires_grad_()
        k, v = k_full.clone().requires_grad_(), v_full.clone().requires_grad_()
        out, saved[seq] = saved_storage_bytes(lambda: _sdpa_documents(q, k, v, docs.attention_pieces, 0.0, dim**-0.5))
        # Oracle: each document alone, causal, then the rank's tokens picked out.
        bounds = torch.nonzero(starts[0]).flatten().tolist() + [seq]
        whole = torch.cat([
            F.scaled_dot_product_attention(q_full[:, :, a:b], k_full[:, :, a:b], v_full[:, :, a:b], is_causal=True, enable_gqa=True)
            for a, b in zip(bounds, bounds[1:])
        ], dim=2)
        torch.testing.assert_close(out, whole[:, :, local_positions(seq, 2, 1)], rtol=1e-5, atol=1e-6)
    assert saved[256] <= 2.2 * saved[128], saved
