"""`qwen35-accel plan` on a VLM: the vision tower's FSDP2 units and bytes per rank against the
tiny VLM sharded by `PARALLELIZER.apply` in a gloo world of 2, per trainable/frozen tower and
`frozen_multimodal_sharding`, under a bf16 policy (trainable parameters fp32 masters, a frozen
tower left in its bf16 storage, as Accelerate does), the trainable tower also with activation
checkpointing (its blocks checkpointed: what each block was called with stays)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from _cli import run_cli
from _dist import run_world
from qwen35_accel.memory import ModelShape, Parallel, StepOptions, VisionShape, estimate, vision_activations

ROOT = Path(__file__).resolve().parents[1]
ROWS, SEQ = 2, 16  # per rank: random_vlm_batch gives each row one 16-patch image (4 image tokens)
# (tower, frozen_multimodal_sharding, activation checkpointing)
CASES = [("trainable", "root", False), ("trainable", "root", True), ("frozen", "root", False), ("frozen", "replicate", False),
         ("frozen", "shard", False)]
TOLERANCE = 0.10  # activations only: the memory model's bound (tests/test_memory_model.py); bytes held are exact


def _config():
    """The tiny VLM's config with a 5 x 5 position grid: 25 rows, which FSDP2 splits 13 + 12."""
    from qwen35_accel.testing.tiny import tiny_vlm_config

    config = tiny_vlm_config()
    config.vision_config.num_position_embeddings = 25
    return config


def _plan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_cli("plan", *args, env=env)  # in this process (tests/_cli.py)


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t._local_tensor if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def _measure(rank: int, tower: str, sharding: str, ac: bool) -> dict:
    """This rank's vision tower after `PARALLELIZER.apply`: its own units' local bytes, the
    local bytes of its parameters, of their gradients after a backward, of their AdamW state
    after a step, and what its forward keeps for backward (saved-tensor hooks; `ac`: and what
    each checkpointed block was called with, which the checkpoint holds)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.fsdp import fsdp_units
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from qwen35_accel.testing.tiny import random_vlm_batch

    torch.manual_seed(0)
    model = hf.Qwen3_5ForConditionalGeneration(_config()).to(torch.bfloat16)
    visual = model.model.visual
    if tower == "frozen":
        visual.requires_grad_(False)
    for p in model.parameters():  # Accelerate's upcast under a bf16 policy: trainable parameters only
        if p.requires_grad:
            p.data = p.data.float()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard_cp",))
    PARALLELIZER.apply(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                       frozen_multimodal_sharding=sharding, activation_checkpointing=ac)
    units = {"+".join(names): _local_bytes(record.parameters()) for names, record in fsdp_units(model)
             if all("visual" in name.split(".") for name in names)}
    params = list(visual.parameters())

    storages: dict[int, int] = {}
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        held = {(p._local_tensor if hasattr(p, "_local_tensor") else p).untyped_storage().data_ptr() for p in model.parameters()}
        if inside[0] and storage.nbytes() and storage.data_ptr() not in held:
            storages.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    def held_by_checkpoint(module, args, kwargs) -> None:  # after FSDP2's pre-hook: the cast arguments, as the checkpoint keeps them
        for value in [*args, *kwargs.values()]:
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    pack(t)

    hooks = [visual.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
             visual.register_forward_hook(lambda *_: inside.__setitem__(0, False))]
    if ac:
        hooks += [block.register_forward_pre_hook(held_by_checkpoint, with_kwargs=True) for block in visual.blocks]
    batch = random_vlm_batch(model.config, ROWS, SEQ, seed=rank)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    for hook in hooks:
        hook.remove()
    loss.backward()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    optimizer.step()
    state = [t for p in params for t in optimizer.state.get(p, {}).values() if t.dim() > 0]  # not AdamW's scalar step count
    return {
        "units": units,
        "parameters": _local_bytes(params),
        "gradients": _local_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer_states": _local_bytes(state),
        "activations": sum(storages.values()),
        "image_tokens": int((batch["input_ids"] == model.config.image_token_id).sum()),
    }


def _world(rank: int, world: int, out: str) -> None:
    results = {f"{tower} {sharding} ac={ac}": _measure(rank, tower, sharding, ac) for tower, sharding, ac in CASES}
    Path(out).with_suffix(f".{rank}.json").write_text(json.dumps(results))


@pytest.mark.multiprocess
def test_plan_lists_the_vision_towers_units_and_bytes_as_the_sharded_model_holds_them(tmp_path):
    run_world(_world, 2, str(tmp_path / "measured"))
    ranks = [json.loads((tmp_path / f"measured.{r}.json").read_text()) for r in range(2)]
    config = _config()
    config.dtype = "bfloat16"
    config.save_pretrained(tmp_path / "model")
    yamls = {}
    for ac in (False, True):  # world 2 (dp_shard 2), as the gloo run above
        yamls[ac] = tmp_path / f"bf16_ac{int(ac)}.yaml"
        text = (ROOT / "accelerate_configs" / "cpu_fsdp2.yaml").read_text().replace("mixed_precision: 'no'", "mixed_precision: bf16")
        yamls[ac].write_text(text.replace("fsdp_activation_checkpointing: false", f"fsdp_activation_checkpointing: {str(ac).lower()}"))
    image_tokens = ranks[0]["trainable root ac=False"]["image_tokens"]
    for tower, sharding, ac in CASES:
        yaml = yamls[ac]
        run = _plan("--model", str(tmp_path / "model"), "--config", str(yaml), "--seq-len", str(SEQ), "--batch-size", str(ROWS),
                    "--backend", "gloo", "--vision-tower", tower, "--image-tokens", str(image_tokens), "--json",
                    env={"QWEN35_ACCEL_FROZEN_MULTIMODAL_SHARDING": sharding})
        assert run.returncode == 0, run.stderr[-3000:]
        p = json.loads(run.stdout)
        case = f"{tower} {sharding} ac={ac}"
        v, measured = p["vision_tower"], [r[case] for r in ranks]
        assert p["memory_assumptions"]["activation_checkpointing"] is ac, case
        # The units: the same modules, each at the bytes its most loaded rank holds.
        assert {"+".join(u["modules"]): u["bytes_per_rank_max"] for u in v["units"]} == {
            name: max(m["units"][name] for m in measured) for name in measured[0]["units"]}, case
        assert v["unit_count"] == len(measured[0]["units"]) == (config.vision_config.depth if v["layout"] == "units" else 0), case
        assert v["trainable"] == (tower == "trainable") and v["parameters"] == VisionShape.from_config(config).parameters()
        # What the memory model holds per rank for the tower, and what the sharded tower holds.
        most = {key: max(m[key] for m in measured) for key in ("parameters", "gradients", "optimizer_states", "activations")}
        assert v["bytes_per_rank"] == most["parameters"], case
        for key in ("parameters", "gradients", "optimizer_states"):
            assert v["memory_per_rank"][key] == most[key], (case, key, v["memory_per_rank"][key], most[key])
        if tower == "frozen":
            assert most["gradients"] == most["optimizer_states"] == most["activations"] == v["memory_per_rank"]["activations"] == 0
        else:
            assert abs(v["memory_per_rank"]["activations"] / most["activations"] - 1) <= TOLERANCE, (v["memory_per_rank"], most)
        # memory_per_rank is the decoder's estimate plus the tower's.
        options = StepOptions(**p["memory_assumptions"])
        text = estimate(ModelShape.from_config(config), Parallel(dp_shard=2), options).as_dict()
        assert p["memory_per_rank"] == {key: text[key] + v["memory_per_rank"][key] for key in text}, case


def test_vision_activations_match_the_unmodified_tower_in_one_process():
    """Transformers' tower as is, in fp32 (casts alias) and bf16, two images of different
    sizes, wider than the tiny VLM: the formula against the saved-tensor hooks."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from qwen35_accel.testing.tiny import tiny_vlm_config

    config = tiny_vlm_config()
    for key, value in dict(hidden_size=128, intermediate_size=256, num_heads=2, depth=2).items():
        setattr(config.vision_config, key, value)
    shape = VisionShape.from_config(config)
    grid = torch.tensor([[1, 8, 8], [1, 16, 8]])
    for dtype in (torch.float32, torch.bfloat16):
        visual = hf.Qwen3_5VisionModel._from_config(config.vision_config).to(dtype)
        pixels = torch.randn(int(grid.prod(-1).sum()), shape.patch_dim, dtype=dtype)
        held = {p.untyped_storage().data_ptr() for p in visual.parameters()}
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in held:
                storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            visual(pixels, grid_thw=grid)
        want = vision_activations(shape, len(pixels), dtype.itemsize, device="cpu")
        assert abs(want / sum(storages.values()) - 1) <= TOLERANCE, (dtype, want, sum(storages.values()))


def test_a_published_shape_vlm_plans_its_vision_tower_on_meta(tmp_path):
    """A Qwen3.5-27B-like VLM (the 27B-like text shape of tests/test_cli.py, Transformers'
    default vision config with the 27B's output width) under fsdp2.yaml: the tower's units
    and bytes as the memory model counts them; --vision-tower none plans the text model."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig

    layers = 64
    text = Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=layers,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    )
    config = Qwen3_5Config(text_config=text.to_dict(), vision_config={"out_hidden_size": 5120}, dtype="bfloat16")
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    yaml = str(ROOT / "accelerate_configs" / "fsdp2.yaml")
    run = _plan("--model", str(tmp_path), "--config", yaml, "--image-tokens", "1024", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    p = json.loads(run.stdout)
    v, shape = p["vision_tower"], VisionShape.from_config(config)
    assert p["architecture"] == "Qwen3_5ForConditionalGeneration" and v["layout"] == "units" and v["trainable"]
    assert v["unit_count"] == shape.depth == 27 and v["parameters"] == shape.parameters()
    assert v["bytes_per_rank"] == v["memory_per_rank"]["parameters"] and v["patches_per_rank"] == 4096
    assert p["sharded_bytes_all_ranks"] == p["model_bytes"] == 4 * p["parameters"]  # fp32 masters, the tower's too
    text_only = json.loads(_plan("--model", str(tmp_path), "--config", yaml, "--vision-tower", "none", "--json").stdout)
    assert text_only["vision_tower"] is None and text_only["parameters"] == p["parameters"] - v["parameters"]


@pytest.mark.parametrize("args, message", [
    (("--model", "tiny-vlm", "--image-tokens", "-1"), "--image-tokens -1: pass 0 to 32 (batch size x seq len"),
    (("--model", "tiny-vlm", "--image-tokens", "33"), "--image-tokens 33: pass 0 to 32"),
    (("--model", "tiny-vlm", "--vision-tower", "none", "--image-tokens", "4"), "pass 0 with --vision-tower none"),
    (("--model", "tiny", "--vision-tower", "frozen"), "--vision-tower frozen: --model tiny is a text model without a vision tower"),
    (("--model", "tiny", "--image-tokens", "4"), "--image-tokens 4: --model tiny is a text model without a vision tower"),
])
def test_plan_refuses_bad_vision_options_in_one_line(args, message, capsys):
    from qwen35_accel.cli import main

    # In process (the CLI's own entry point; tests/test_cli.py runs it as a command).
    code = main(["plan", *args, "--config", str(ROOT / "accelerate_configs" / "cpu_fsdp2.yaml"), "--seq-len", "32"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
