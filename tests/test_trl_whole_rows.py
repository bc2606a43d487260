"""TRL's fused head on whole rows under context parallelism (what DPOTrainer and KTOTrainer call:
`model(input_ids, attention_mask, labels, fused_lm_head=True)`, labels unshifted) equals TRL's head
on the unmodified model in one process: every per-token field of the whole rows, the loss, a
DPO-style per-sequence loss (sums over the completion, lengths, a frozen reference model's
log-probs under no_grad) and every gradient, with the decoder run under cp 2 (each rank its chunks),
and under cp 2 × tp 2 with the lm_head split by vocab."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_world
from _parity import assert_close, hf_name

pytestmark = pytest.mark.multiprocess

OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")  # what DPOTrainer asks its policy's head for


def preference_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    """[chosen; rejected] rows as TRL's DPO collator makes them: right-padded (13 positions, not a
    multiple of 2·cp), prompts masked out of the labels, pads -100."""
    gen = torch.Generator().manual_seed(5)
    lengths, prompts = [13, 9, 11, 6], [4, 3, 4, 3]
    rows, seq = len(lengths), max(lengths)
    input_ids = torch.randint(1, vocab_size, (rows, seq), generator=gen)
    positions = torch.arange(seq)
    attention_mask = (positions < torch.tensor(lengths)[:, None]).long()
    completion_mask = attention_mask * (positions >= torch.tensor(prompts)[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
            "labels": input_ids.masked_fill(completion_mask == 0, -100)}


def dpo_style_loss(logps: torch.Tensor, ref_logps: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Sigmoid plus IPO (length-normalised) terms, as DPOTrainer reduces the per-token fields."""
    chosen, rejected = (logps - ref_logps).chunk(2)
    chosen_len, rejected_len = completion_mask.sum(1).chunk(2)
    sigmoid = -torch.nn.functional.logsigmoid(0.1 * (chosen - rejected))
    ipo = (chosen / chosen_len - rejected / rejected_len - 1 / (2 * 0.1)) ** 2
    return (sigmoid + ipo).mean()


def _worker(rank: int, world: int, cp: int) -> None:
    import trl.trainer.dpo_trainer as dpo_module
    from trl.trainer.utils import add_fused_lm_head

    from qwen35_accel import PARALLELIZER, install
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    install()  # the plugin's patch points, TRL's modules included (imported above)
    reference, reference_ref = build_tiny_causal_lm(seed=0), build_tiny_causal_lm(seed=1)
    add_fused_lm_head(reference, outputs=OUTPUTS)  # TRL's own head, one process
    add_fused_lm_head(reference_ref)
    model, ref_model = build_tiny_causal_lm(seed=0), build_tiny_causal_lm(seed=1)
    dpo_module.add_fused_lm_head(model, outputs=OUTPUTS)  # as DPOTrainer calls it
    dpo_module.add_fused_lm_head(ref_model)
    ref_model.requires_grad_(False)
    tp = world // cp  # tp > 1: the lm_head split by vocab too, TRL's head combining the slices
    mesh = init_device_mesh("cpu", (1, 1, cp, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    PARALLELIZER.apply(model, mesh, vocab_parallel_lm_head=tp > 1)
    PARALLELIZER.apply(ref_model, mesh, vocab_parallel_lm_head=tp > 1)

    batch = preference_batch(model.config.vocab_size)
    completion_mask = batch.pop("completion_mask")
    want, got = reference(**batch, fused_lm_head=True), model(**batch, fused_lm_head=True)  # whole rows on every rank
    seq = batch["input_ids"].shape[1]
    assert got.log_probs.shape == (4, seq - 1) and torch.equal(got.label_mask, want.label_mask)
    assert_close(got.loss, want.loss, "loss")
    for name in OUTPUTS:
        if name == "is_top1":
            assert torch.equal(got.is_top1, want.is_top1), name
        else:
            assert_close(getattr(got, name).detach(), getattr(want, name).detach(), name)
    with torch.no_grad():  # the reference model's call in DPOTrainer
        want_ref, got_ref = (m(**batch, fused_lm_head=True).log_probs.sum(1) for m in (reference_ref, ref_model))
    assert_close(got_ref, want_ref, "reference log-probs")
    dpo_style_loss(want.log_probs.sum(1), want_ref, completion_mask).backward()
    loss = dpo_style_loss(got.log_probs.sum(1), got_ref, completion_mask)
    assert_close(loss.detach(), dpo_style_loss(want.log_probs.sum(1), want_ref, completion_mask).detach(), "dpo loss")
    loss.backward()  # FSDP2 averages over the cp ranks: each computed the whole rows' loss
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(gather_tensor_parallel(model, name, p.grad), ref_params[hf_name(name)].grad, f"grad of {name}")

    # A per-token key it does not shard (TRL's DPO collator on a VLM passes `mm_token_type_ids`): refused
    # on every rank, naming it (docs/vlm.md: DPO/KTO with images under CP).
    with pytest.raises(NotImplementedError, match="also passes per-token mm_token_type_ids, which it would not shard"):
        model(**batch, mm_token_type_ids=torch.zeros_like(batch["input_ids"]), fused_lm_head=True)
    # The whole-row precondition: the same rows on every rank of the cp group, refused on every rank otherwise.
    other = {k: v.roll(mesh["cp"].get_local_rank(), dims=0) for k, v in batch.items()}
    with pytest.raises(ValueError, match="needs the same whole rows on every rank of the cp group"):
        model(**other, fused_lm_head=True)


@pytest.mark.parametrize("world,cp", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow)], ids=["cp2", "cp2xtp2"])
def test_trl_fused_head_on_whole_rows_under_cp_equals_one_process(world, cp):
    run_world(_worker, world, cp)


def test_trl_trainers_under_cp_or_tp_with_another_trl_are_refused_naming_the_version():
    """The whole-row path is written against TRL 1.16's fused head, and GRPO/RLOO's replicas against
    its sampling: another TRL keeps the refusal, naming what was found and what is needed."""
    from qwen35_accel.integrations.trl.trainers import trl_under_cp_error
    from qwen35_accel.integrations.trl.whole_rows import whole_rows_supported

    from qwen35_accel.integrations.trl.trainers import trl_under_tp_error

    assert all(whole_rows_supported(name)[0] for name in ("DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer"))
    assert not whole_rows_supported("SFTTrainer")[0]  # sharded by the Trainer, not on whole rows
    message = str(trl_under_cp_error("KTOTrainer", 2, "1.17.0"))
    assert message.startswith("TRL's KTOTrainer under context parallelism (cp_size=2) runs with qwen35_accel for TRL 1.16.x")
    assert "found trl 1.17.0" in message and "trl>=1.16,<1.17" in message
    message = str(trl_under_tp_error("GRPOTrainer", 2, "1.17.0"))
    assert message.startswith("TRL's GRPOTrainer under tensor parallelism (tp_size=2) runs with qwen35_accel for TRL 1.16.x")
    assert "found trl 1.17.0" in message and "trl>=1.16,<1.17" in message
