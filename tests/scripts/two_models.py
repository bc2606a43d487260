"""A policy and a frozen reference model prepared together, as a custom DPO/distillation loop
does: `accelerator.prepare(model, ref_model, optimizer)`, 3 SGD steps of the policy's loss;
both models' losses per step in OUTPUT_DIR/losses.json (rank 0), and which models qwen35_accel
prepared.

    accelerate launch --config_file … tests/scripts/two_models.py OUTPUT_DIR    # FSDP2 / cp
    python tests/scripts/two_models.py OUTPUT_DIR                               # the reference: one process
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, set_seed

from qwen35_accel.parallel.prepared import prepared_by_accelerate

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ROWS, SEQ, STEPS = 4, 32, 3


def tiny_model() -> torch.nn.Module:
    set_seed(0)
    config = AutoConfig.from_pretrained(RECIPES / "configs" / "tiny_qwen35.json")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def main(out: str) -> None:
    model, ref_model = tiny_model(), tiny_model()
    with torch.no_grad():  # the reference differs from the policy
        for p in ref_model.parameters():
            p.mul_(0.9)
    ref_model.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rows, local = slice(None), (lambda batch: batch)
    if distributed:
        from accelerate import Accelerator

        accelerator = Accelerator()
        model, ref_model, optimizer = accelerator.prepare(model, ref_model, optimizer)
        mesh = accelerator.torch_device_mesh
        names = mesh.mesh_dim_names or ()
        dp = mesh["dp_shard"].size() if "dp_shard" in names else 1
        replica = mesh["dp_shard"].get_local_rank() if "dp_shard" in names else 0
        rows = slice(replica * ROWS // dp, (replica + 1) * ROWS // dp)
        if "cp" in names:
            from qwen35_accel.context_parallel import shard_batch

            local = lambda batch: shard_batch(batch, mesh["cp"])
    prepared = [prepared_by_accelerate(m) for m in (model, ref_model)]
    losses: dict[str, list[float]] = {"policy": [], "reference": []}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(1, 256, (ROWS, SEQ), generator=gen)
        batch = local({"input_ids": ids[rows], "labels": ids[rows].clone()})
        with torch.no_grad():
            ref_loss = ref_model(**batch).loss.detach()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for key, value in (("policy", loss.detach()), ("reference", ref_loss)):
            value = value.clone()
            if distributed:  # every rank reports its cp group's mean; dp replicas hold equal token counts
                dist.all_reduce(value, op=dist.ReduceOp.AVG)
            losses[key].append(value.item())
    if not distributed or dist.get_rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "losses.json").write_text(json.dumps({"losses": losses, "prepared": prepared}))


if __name__ == "__main__":
    main(sys.argv[1])
