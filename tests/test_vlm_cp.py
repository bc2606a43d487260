"""Qwen3_5ForConditionalGeneration with images and videos under context parallelism: each cp
rank encodes a share of the images, the embeddings are all-gathered, the mRoPE positions are
computed on the whole rows; loss, every gradient (vision tower included) and the evaluation
logits equal one process on the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_world
from _launched import Run, register
from _parity import assert_close, assert_same_log_history, hf_name

pytestmark = pytest.mark.multiprocess

SEQ = 32  # cp 2: four chunks of 8, boundaries at 8 (rank 0 | rank 1), 16, 24 (rank 1 | rank 0)
# (kind, first token, h, w): h*w/4 tokens. Different sizes; tokens 3..10, 5..8 and 21..24
# straddle a boundary between ranks; row 1 is right-padded.
FULL = ([[("image", 3, 4, 8), ("image", 21, 4, 4)], [("video", 5, 4, 4), ("image", 14, 8, 4)]], [0, 3])
# One image and a text-only row: under cp 2 one rank has no share (the placeholder runs there).
ONE = ([[("image", 10, 4, 4)], []], [0, 0])
TEXT = ([[], []], [0, 0])
TOWERS = (("trainable", "shard"), ("frozen", "root"), ("frozen", "shard"))


def _vlm(tower: str):
    from qwen35_accel.testing.tiny import build_tiny_vlm

    model = build_tiny_vlm(seed=0)
    if tower == "frozen":
        model.model.visual.requires_grad_(False)
    return model


def _check_images_under_cp(mesh, steps: list[list[tuple]], towers=TOWERS, ac: bool = False) -> None:
    """`steps[s][dp_rank]`: a micro-step's (rows, padding) per data-parallel rank. For every tower
    setting: the mean of the micro-steps' losses, every gradient (gathered over dp and tp) and
    the first micro-step's evaluation logits equal one process on each micro-step's global batch.
    `ac`: with activation checkpointing (a trainable tower's blocks run twice per micro-step)."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import gather_sequence, shard_batch
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel
    from qwen35_accel.testing.tiny import concat_vlm_batches, placed_vlm_batch, tiny_vlm_config

    config = tiny_vlm_config()
    dp_rank = mesh.get_local_rank("dp_shard")
    batches = [[placed_vlm_batch(config, rows, SEQ, seed=200 + 10 * s + r, padding=padding)
                for r, (rows, padding) in enumerate(step)] for s, step in enumerate(steps)]
    for tower, policy in towers:
        what = f"{tower} tower, {policy}, activation checkpointing {ac}"
        reference = _vlm(tower)
        ref_loss = sum(reference(**concat_vlm_batches(step)).loss for step in batches) / len(batches)
        ref_loss.backward()
        model = PARALLELIZER.apply(_vlm(tower), mesh, frozen_multimodal_sharding=policy, activation_checkpointing=ac)
        encoded: list[int] = []  # patches per tower call on this rank
        model.model.visual.register_forward_hook(lambda module, args, out: encoded.append(args[0].shape[0]))
        runs: list[int] = []  # a pre-hook: a non-reentrant recomputation stops before forward hooks
        model.model.visual.blocks[-1].mlp.register_forward_pre_hook(lambda *_: runs.append(1))
        losses = []
        for step in batches:
            loss = model(**shard_batch(step[dp_rank], mesh["cp"])).loss / len(batches)
            loss.backward()
            losses.append(loss.detach())
            _check_split(encoded, step[dp_rank], mesh["cp"])
        if tower == "trainable":  # one tower call per micro-step (a share, or the placeholder), recomputed if checkpointed
            assert len(runs) == len(batches) * (2 if ac else 1), (ac, runs)
        # Every cp rank holds the dp rank's loss; equal label counts per dp rank: the mean is the global loss.
        global_loss = torch.stack(losses).sum()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        assert_close(global_loss, ref_loss.detach(), f"loss ({what})")
        ref_params = dict(reference.named_parameters())
        vision = 0
        for name, p in model.named_parameters():
            r = ref_params[hf_name(name)]
            assert (p.grad is None) == (r.grad is None) == (not p.requires_grad), f"{name}: {what}"
            if p.grad is not None:
                assert_close(gather_tensor_parallel(model, name, p.grad), r.grad, f"grad of {name} ({what})")
                vision += ".visual." in name
        assert vision == (len(list(reference.model.visual.parameters())) if tower == "trainable" else 0), what
        with torch.no_grad():
            local = model(**shard_batch(batches[0][dp_rank], mesh["cp"])).logits
            logits = gather_sequence(local, mesh["cp"])
            real = batches[0][dp_rank]["attention_mask"].bool()  # a padded query's output is not defined (test_cp_model)
            assert_close(logits[real], reference(**batches[0][dp_rank]).logits[real], f"eval logits ({what})")


def _check_split(encoded: list[int], batch: dict[str, torch.Tensor], cp_mesh) -> None:
    """One tower call on every cp rank, over its share of the patches (the placeholder's 4 when
    it has none): together the batch's patches once, not every image on every rank."""
    from qwen35_accel.parallel.context_parallel.vision_split import vision_shares

    if "image_grid_thw" not in batch and "video_grid_thw" not in batch:
        encoded.clear()  # text only: the mixed-batch placeholder's business (test_vlm.py)
        return
    assert len(encoded) == 1, encoded
    patches = torch.cat([batch[k] for k in ("image_grid_thw", "video_grid_thw") if k in batch]).prod(-1).tolist()
    shares = vision_shares(patches, cp_mesh.size())
    mine = torch.tensor([encoded.pop()])
    everyone = [torch.zeros_like(mine) for _ in shares]
    dist.all_gather(everyone, mine, group=cp_mesh.get_group())
    assert [int(n) for n in everyone] == [sum(patches[i] for i in share) or 4 for share in shares], (everyone, patches)
    assert len(patches) < 2 or max(everyone) < sum(patches), "every cp rank encoded every image"


def _mesh(world: int, dp: int = 1, tp: int = 1):
    mesh = init_device_mesh("cpu", (1, dp, world // dp // tp, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def _worker(rank: int, world: int, steps: list[list[tuple]], dp: int, tp: int, towers=TOWERS, ac: bool = False) -> None:
    _check_images_under_cp(_mesh(world, dp, tp), steps, towers, ac)


@pytest.mark.parametrize("ac", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["no_ac", "ac"])
def test_images_under_cp2_equal_one_process(ac):
    # Two micro-steps: images of several sizes, a video, padding, boundaries straddled; then one image (one rank has no share).
    # Checkpointed (trainable tower): each rank's share, and the placeholder of the rank without one, recomputed in backward.
    run_world(_worker, 2, [[FULL], [ONE]], 1, 1, TOWERS[:1] if ac else TOWERS, ac)


@pytest.mark.slow
def test_images_under_dp2_cp2_equal_one_process():
    # Second micro-step: a dp rank with text only (the placeholder) beside one with images.
    run_world(_worker, 4, [[FULL, ONE], [TEXT, FULL]], 2, 1, TOWERS[:2])


@pytest.mark.slow
def test_images_under_cp2_tp2_equal_one_process():
    run_world(_worker, 4, [[FULL], [ONE]], 1, 2, TOWERS[:2])


def test_vision_shares_balance_patches_deterministically():
    from qwen35_accel.parallel.context_parallel.vision_split import vision_shares

    assert vision_shares([32, 16, 32, 16], 2) == [[0, 1], [2, 3]]
    assert vision_shares([16], 2) == [[0], []]
    assert vision_shares([], 3) == [[], [], []]
    assert vision_shares([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]


def _packed_worker(rank: int, world: int) -> None:
    """Packed rows (position_ids restarting mid-row) with images: the same refusal on every rank."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import placed_vlm_batch

    model = PARALLELIZER.apply(_vlm("trainable"), _mesh(world))
    batch = placed_vlm_batch(model.config, *ONE[:1], SEQ, seed=1, padding=ONE[1])
    batch["position_ids"] = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)]).expand(2, -1)
    with pytest.raises(NotImplementedError, match=r"^packed rows \(several documents per row\) with images"):
        model(**shard_batch(batch, _mesh(world)["cp"]))
    dist.barrier()  # every rank got here: none is left waiting in a collective


def test_packed_rows_with_images_are_refused_on_every_rank_under_cp():
    run_world(_packed_worker, 2)


SCRIPT = Path(__file__).parent / "scripts" / "vlm_cp.py"


def _launched(command: list[str]):
    from qwen35_accel.testing.launch import run_launch

    return run_launch(command)


register(**{"vlm_cp/single": Run(None, SCRIPT, ("{out}",)), "vlm_cp/cp2": Run("cpu_fsdp2_cp2.yaml", SCRIPT, ("{out}",))})


@pytest.mark.slow
@pytest.mark.launches("vlm_cp/single", "vlm_cp/cp2")
def test_trainer_with_images_under_cp2_trains_evaluates_and_predicts_as_one_process(launched):
    """tests/scripts/vlm_cp.py: a collator's VLM batches (images of several sizes across chunk
    boundaries, a video, padding, a text-only row) under cpu_fsdp2_cp2.yaml: the per-step losses
    and grad norms, evaluate()'s loss and metrics and predict()'s logits equal one process's."""
    result = launched("vlm_cp/cp2")
    single, launched_out = launched("vlm_cp/single").out, result.out
    assert "Qwen3_5ForConditionalGeneration prepared by qwen35_accel" in result.stderr and "cp=2" in result.stderr
    # fp32: the launch sums the same terms in another order (chunks, ranks).
    assert_same_log_history(launched_out, single, rtol=1e-5)
    got, want = (torch.load(out / "predictions.pt") for out in (launched_out, single))
    torch.testing.assert_close(got["label_ids"], want["label_ids"], rtol=0, atol=0)
    # Every position whose attention_mask is 1, labelled or not (docs/evaluation.md's line): a
    # right-padded query's output is not defined under CP (test_cp_model).
    real = want["attention_mask"].bool()
    assert not real.all() and torch.equal(got["attention_mask"], want["attention_mask"])
    assert got["logits"].shape == want["logits"].shape
    # fp32: logits after 3 layers reduced in another order (observed below 1e-5 relative).
    torch.testing.assert_close(got["logits"][real], want["logits"][real], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_trainer_with_packed_image_rows_under_cp2_is_refused_on_every_rank(tmp_path):
    from qwen35_accel.testing.launch import accelerate_launch_command, assert_refused_on_every_rank

    result = _launched(accelerate_launch_command("cpu_fsdp2_cp2.yaml", SCRIPT, str(tmp_path / "out"), "--packed"))
    assert_refused_on_every_rank(result, "NotImplementedError", "packed rows (several documents per row) with images")
