"""TRL's fused LM head (`add_fused_lm_head`, what its SFT/DPO/GRPO/RLOO/KTO trainers compute
their loss with) on a model with a vocab-parallel lm_head equals TRL's head on the unmodified
model in one process: loss, every per-token field, every gradient."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_world
from _parity import assert_close, hf_name

pytestmark = pytest.mark.multiprocess

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _worker(rank: int, world: int, cp: int, temperature: float) -> None:
    import trl.trainer.sft_trainer as sft_module
    from trl.trainer.utils import add_fused_lm_head

    from qwen35_accel import PARALLELIZER, install
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.integrations.trl.fused_head import check_no_unwrapped_trl_head
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    install()  # the plugin's patch points, TRL's modules included (imported above)
    tp = world // cp
    reference = build_tiny_causal_lm(seed=0)
    add_fused_lm_head(reference, temperature=temperature, outputs=OUTPUTS)  # TRL's own head
    model = build_tiny_causal_lm(seed=0)
    sft_module.add_fused_lm_head(model, temperature=temperature, outputs=OUTPUTS)  # as SFTTrainer calls it
    check_no_unwrapped_trl_head(model)
    mesh = init_device_mesh("cpu", (1, 1, cp, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    PARALLELIZER.apply(model, mesh, vocab_parallel_lm_head=True)
    assert model.lm_head.weight.shape[0] == model.config.vocab_size // tp

    batch = random_batch(2, 16, model.config.vocab_size, seed=3)
    batch["labels"][0, :5] = -100  # a prompt, masked as TRL's collators do
    want = reference(**batch, fused_lm_head=True)
    want.loss.backward()
    local = batch
    if cp > 1:  # what the Trainer passes under CP: this rank's chunks and shift_labels
        local = shard_batch(batch, mesh["cp"])
        assert "shift_labels" in local
    got = model(**local, fused_lm_head=True)
    mask = got.label_mask
    if cp > 1:
        from qwen35_accel.context_parallel import gather_sequence

        def whole(t: torch.Tensor) -> torch.Tensor:  # this rank's chunks -> [batch, seq], the last position dropped
            return gather_sequence(t.contiguous(), mesh["cp"])[:, :-1]

        # Each rank's loss is its tokens' mean: the batch's is the count-weighted sum over cp.
        local_sum = got.loss.detach() * mask.sum()
        torch.distributed.all_reduce(local_sum, group=mesh["cp"].get_group())
        assert_close(local_sum / whole(mask).sum(), want.loss.detach(), "loss")
    else:
        whole = lambda t: t  # noqa: E731
        assert_close(got.loss.detach(), want.loss.detach(), "loss")
    assert torch.equal(whole(mask), want.label_mask)
    for name in OUTPUTS:
        value, expected = whole(getattr(got, name).detach()), getattr(want, name).detach()
        if name == "is_top1":
            assert torch.equal(value, expected), name
        else:
            assert_close(value, expected, name)
    # As the Trainer has it: each rank's sum over the batch's count, times the cp ranks FSDP2
    # averages the gradient over.
    (got.loss * mask.sum() / whole(mask).sum() * cp).backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = gather_tensor_parallel(model, name, p.grad)
        assert_close(grad, ref_params[hf_name(name)].grad, f"grad of {name}")
    # Generation would sample from this rank's vocab slice: refused (every rank alike, before any collective).
    with pytest.raises(NotImplementedError, match="generation .* with a vocab-parallel lm_head"):
        model.generate(input_ids=batch["input_ids"][:, :4], max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("world,cp", [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)], ids=["tp2", "cp2xtp2"])
def test_trl_fused_head_over_vocab_parallel_lm_head_equals_one_process(world, cp):
    run_world(_worker, world, cp, 0.8)


@pytest.mark.slow
def test_losses_from_vocab_sliced_logits_are_refused_on_every_rank(tmp_path):
    """Label smoothing (or a compute_loss_func) computes the loss from `outputs.logits`, which
    with a vocab-parallel lm_head hold this rank's vocab slice: refused at the first step."""
    from qwen35_accel.testing.launch import RECIPE, accelerate_launch_command, assert_refused_on_every_rank, run_launch

    result = run_launch(
        accelerate_launch_command(
            "cpu_fsdp2_tp2.yaml", RECIPE, "--output_dir", str(tmp_path), "--max_steps", "2", "--label_smoothing_factor", "0.1"
        ),
        env={"QWEN35_ACCEL_VOCAB_PARALLEL_LM_HEAD": "1"},
    )
    assert_refused_on_every_rank(
        result, "NotImplementedError", "label smoothing (label_smoothing_factor > 0) computes the loss"
    )
