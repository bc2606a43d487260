"""Qwen3_5ForConditionalGeneration with a frozen vision tower, under each sharding policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from _dist import run_world
from _launched import Run, register
from _parity import assert_close, assert_grads_match, assert_same_log_history, full, hf_name

pytestmark = pytest.mark.multiprocess

ROWS = 2


def _frozen_vlm():
    from qwen35_accel.testing.tiny import build_tiny_vlm

    model = build_tiny_vlm(seed=0)
    model.model.visual.requires_grad_(False)
    return model


def _vlm_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import random_vlm_batch

    reference = _frozen_vlm()
    batch = random_vlm_batch(reference.config, ROWS * world, 24, seed=11)
    ref_loss = reference(**batch).loss
    ref_loss.backward()

    local = {k: v[rank * ROWS : (rank + 1) * ROWS] for k, v in batch.items() if k != "pixel_values"}
    local["pixel_values"] = batch["pixel_values"][rank * ROWS * 16 : (rank + 1) * ROWS * 16]

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    for policy in ("root", "replicate", "shard"):
        model = PARALLELIZER.apply(_frozen_vlm(), mesh, frozen_multimodal_sharding=policy)
        visual = model.model.visual
        block_is_unit = isinstance(visual.blocks[0], FSDPModule)
        vision_sharded = isinstance(visual.blocks[0].attn.qkv.weight, DTensor)
        assert (block_is_unit, vision_sharded) == {
            "root": (False, True),
            "replicate": (False, False),
            "shard": (True, True),
        }[policy], (policy, block_is_unit, vision_sharded)

        loss = model(**local).loss
        loss.backward()
        # Equal token counts per row: the global loss is the mean of the rank means.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        assert_close(global_loss, ref_loss.detach(), f"loss ({policy})")
        assert assert_grads_match(model, reference) > 0
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        opt.step()
        assert torch.isfinite(model(**local).loss), policy


def test_frozen_vision_tower_under_each_policy_trains_with_single_process_text_grads():
    run_world(_vlm_worker, 2)


# Mixed image/text batches: a rank without images runs the tower on a placeholder whose
# contribution is exactly zero, so every sharding of the tower keeps its collectives matched.

SEQ = 16
TOWERS = (("trainable", "shard"), ("frozen", "root"), ("frozen", "replicate"), ("frozen", "shard"))


def _vlm(tower: str):
    from qwen35_accel.testing.tiny import build_tiny_vlm

    return _frozen_vlm() if tower == "frozen" else build_tiny_vlm(seed=0)


def _mesh(world: int, dp_replicate: int = 1, tp: int = 1):
    mesh = init_device_mesh("cpu", (dp_replicate, world // dp_replicate // tp, 1, tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def _check_mixed_steps(mesh, media: list[list[list[str | None]]], towers=TOWERS, ac: bool = False) -> None:
    """`media[step][dp_rank]`: each micro-step's rows per data-parallel rank. Every tower
    setting: the mean of the micro-steps' losses and every gradient (vision tower included)
    equal one process computing each micro-step's global batch. `ac`: with activation
    checkpointing (a trainable tower's blocks run twice per micro-step: forward, recompute)."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel
    from qwen35_accel.parallel.vision_placeholder import PLACEHOLDER_HOOK_ATTR
    from qwen35_accel.testing.tiny import concat_vlm_batches, mixed_vlm_batch, tiny_vlm_config

    config = tiny_vlm_config()
    dp_rank = mesh.get_local_rank("dp_replicate") * mesh["dp_shard"].size() + mesh.get_local_rank("dp_shard")
    steps = [[mixed_vlm_batch(config, rows, SEQ, seed=100 + 10 * s + r) for r, rows in enumerate(step)]
             for s, step in enumerate(media)]
    for tower, policy in towers:
        reference = _vlm(tower)
        ref_loss = sum(reference(**concat_vlm_batches(batches)).loss for batches in steps) / len(steps)
        ref_loss.backward()

        model = PARALLELIZER.apply(_vlm(tower), mesh, frozen_multimodal_sharding=policy, activation_checkpointing=ac)
        has_units = tower == "trainable" or policy == "shard"
        assert (getattr(model.model, PLACEHOLDER_HOOK_ATTR, None) is not None) == has_units, (tower, policy)
        # A pre-hook: a non-reentrant recomputation stops once the last saved tensor is back, before forward hooks.
        runs: list[int] = []
        model.model.visual.blocks[-1].mlp.register_forward_pre_hook(lambda *_: runs.append(1))
        losses = []
        for batches in steps:
            loss = model(**batches[dp_rank]).loss / len(steps)
            loss.backward()
            losses.append(loss.detach())
        if has_units:  # a tower with units runs on every micro-step (images, or the placeholder)
            assert len(runs) == len(steps) * (2 if ac and tower == "trainable" else 1), (tower, policy, ac, runs)
        # Equal label counts on every rank: the global loss is the mean of the dp ranks' means.
        global_loss = torch.stack(losses).sum()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        what = f"{tower} tower, {policy}, media {media}, activation checkpointing {ac}"
        assert_close(global_loss, ref_loss.detach(), f"loss ({what})")
        ref_params = dict(reference.named_parameters())
        trained = []
        for name, p in model.named_parameters():
            r = ref_params[hf_name(name)]
            assert (p.grad is None) == (r.grad is None) == (not p.requires_grad), f"{name}: {what}"
            if p.grad is not None:  # gathered over dp (DTensor) and, split by TP, over tp
                assert_close(gather_tensor_parallel(model, name, p.grad), r.grad, f"grad of {name} ({what})")
                trained.append(name)
        with torch.no_grad():  # evaluation: mixed ranks, forward collectives only
            logits = model(**steps[0][dp_rank]).logits
            assert_close(logits, reference(**steps[0][dp_rank]).logits, f"eval logits ({what})")
        vision = [name for name in trained if ".visual." in name]
        assert len(vision) == (len(list(reference.model.visual.parameters())) if tower == "trainable" else 0), what
        assert len(trained) > len(vision), what


def _mixed_worker(
    rank: int, world: int, media: list[list[list[str | None]]], dp_replicate: int = 1, tp: int = 1, ac: bool = False
) -> None:
    # Checkpointed: the trainable tower (its blocks checkpointed) and a frozen one with units (only the decoder's).
    _check_mixed_steps(_mesh(world, dp_replicate, tp), media, TOWERS[::3] if ac else TOWERS, ac)


IMAGES, TEXT, VIDEOS, BOTH = ["image", "image"], [None, None], ["video", None], ["image", "video"]


# BOTH: Transformers calls the tower twice (images, then videos); the hook makes it one call.
@pytest.mark.parametrize("media", [[IMAGES, TEXT], [TEXT, IMAGES], [VIDEOS, TEXT], [BOTH, TEXT], [BOTH, IMAGES]],
                         ids=["images-text", "text-images", "videos-text", "both-text", "both-images"])
def test_mixed_image_text_ranks_equal_one_process_on_every_tower_sharding(media):
    run_world(_mixed_worker, 2, [media])


@pytest.mark.parametrize("ac", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["no_ac", "ac"])
def test_mixed_micro_steps_accumulate_to_one_process_gradients(ac):
    # Micro-steps: images on rank 0 only, an image and a video on rank 1 only, text everywhere.
    # Checkpointed: each vision block and decoder layer recomputed in backward, the placeholder's too.
    run_world(_mixed_worker, 2, [[IMAGES, TEXT], [TEXT, BOTH], [TEXT, TEXT]], 1, 1, ac)


def test_mixed_ranks_under_hsdp_equal_one_process():
    run_world(_mixed_worker, 2, [[IMAGES, TEXT]], 2)


def test_mixed_ranks_under_dp2_tp2_equal_one_process():
    # The tower is not split by TP: tp ranks share a batch and the tower's units span dp.
    run_world(_mixed_worker, 4, [[IMAGES, TEXT]], 1, 2)


def _text_only_under_cp_worker(rank: int, world: int) -> None:
    """cp 2, trainable tower, text only on every rank: the placeholder runs under CP too;
    loss and decoder gradients equal one process, the tower's gradients are exactly zero
    (the reference's tower gets none)."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import build_tiny_vlm, mixed_vlm_batch

    mesh = init_device_mesh("cpu", (1, 1, world, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    reference = build_tiny_vlm(seed=0)
    batch = mixed_vlm_batch(reference.config, [None, None], SEQ, seed=5)
    del batch["mm_token_type_ids"]  # text only: Transformers needs it with images alone
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    model = PARALLELIZER.apply(build_tiny_vlm(seed=0), mesh)
    loss = model(**shard_batch(batch, mesh["cp"])).loss
    loss.backward()
    assert_close(loss.detach(), ref_loss.detach(), "loss under cp")
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[hf_name(name)]
        if r.grad is None:
            assert ".visual." in name and torch.equal(full(p.grad), torch.zeros_like(r)), name
        else:
            assert_close(full(p.grad), r.grad, f"grad of {name} under cp")


def test_text_only_vlm_with_trainable_tower_under_cp_equals_one_process():
    run_world(_text_only_under_cp_worker, 2)


def test_placeholder_adds_exactly_zero_to_loss_and_gradients():
    """One process, the hook alone: a text-only forward (keywords or positional `input_ids`)
    gives bitwise Transformers' loss and decoder gradients, and every tower parameter a
    gradient of exactly zero (so FSDP2 reduces the same tensors on every rank)."""
    from qwen35_accel.parallel.vision_placeholder import install_vision_placeholder
    from qwen35_accel.testing.tiny import build_tiny_vlm, mixed_vlm_batch

    reference, model = build_tiny_vlm(seed=0), build_tiny_vlm(seed=0)
    assert install_vision_placeholder(model) and not install_vision_placeholder(model)
    batch = mixed_vlm_batch(reference.config, [None, None], SEQ, seed=3)
    reference(**batch).loss.backward()
    loss = model(**batch).loss
    loss.backward()
    assert torch.equal(loss, reference(**batch).loss)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        if r.grad is None:
            assert ".visual." in name and p.grad is not None and not p.grad.any(), name
        else:
            assert torch.equal(p.grad, r.grad), name
    positional = model.model(batch["input_ids"]).last_hidden_state  # the hook binds positional arguments
    assert torch.equal(positional, reference.model(batch["input_ids"]).last_hidden_state)


def test_images_and_videos_in_one_tower_call_equal_transformers_two_calls():
    from qwen35_accel.parallel.vision_placeholder import install_vision_placeholder
    from qwen35_accel.testing.tiny import build_tiny_vlm, mixed_vlm_batch

    reference, model = build_tiny_vlm(seed=0), build_tiny_vlm(seed=0)
    install_vision_placeholder(model)
    batch = mixed_vlm_batch(reference.config, ["image", "video", "image"], SEQ, seed=4)
    calls = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    ref_loss, loss = reference(**batch).loss, model(**batch).loss
    assert len(calls) == 1
    ref_loss.backward()
    loss.backward()
    # fp32: one call over 3 images' patches instead of 2 calls (matmuls of other shapes).
    assert_close(loss, ref_loss, "loss")
    assert_grads_match(model, reference)

MIXED_SCRIPT = Path(__file__).parent / "scripts" / "vlm_mixed.py"
MIXED_TOWERS = {"trainable": ((), {}), "frozen-shard": (("--frozen_tower",), {"QWEN35_ACCEL_FROZEN_MULTIMODAL_SHARDING": "shard"})}
register(**{
    name: run
    for tower, (flags, env) in MIXED_TOWERS.items()
    for name, run in (
        (f"vlm/mixed-{tower}-single", Run(None, MIXED_SCRIPT, ("{out}", "--per_device_train_batch_size", "4", *flags))),
        (f"vlm/mixed-{tower}", Run("cpu_fsdp2.yaml", MIXED_SCRIPT, ("{out}", "--per_device_train_batch_size", "2", *flags), env=env)),
    )
})


@pytest.mark.slow
@pytest.mark.parametrize(
    "tower", [pytest.param(t, marks=pytest.mark.launches(f"vlm/mixed-{t}-single", f"vlm/mixed-{t}")) for t in MIXED_TOWERS]
)
def test_trainer_on_a_mixed_image_text_dataset_under_fsdp2_logs_one_process_losses_and_grad_norms(launched, tower):
    """tests/scripts/vlm_mixed.py: every micro-step mixes ranks with and without images (a video too);
    2 micro-steps per step. The launch's per-step loss and grad_norm equal one process's."""
    launch = launched(f"vlm/mixed-{tower}")
    assert "Qwen3_5ForConditionalGeneration prepared by qwen35_accel" in launch.stderr
    # fp32: the launch sums the same terms in another order (ranks, FSDP2 reduce-scatters).
    assert_same_log_history(launch.out, launched(f"vlm/mixed-{tower}-single").out, rtol=1e-5)
