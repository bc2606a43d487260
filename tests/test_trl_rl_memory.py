"""What a GRPO training forward under context parallelism keeps for backward: TRL's fused head
on one whole row (a left-padded prompt and a long completion, only the completion labelled, as
GRPOTrainer builds it) at cp 2 keeps about half the per-rank activations of the same forward in
one process, because each rank runs only its chunks of the decoder; the same model with its CP
paused (every rank computes the whole row, as a replicated decoder would) keeps as much as one
process. The per-token fields gathered back to whole rows are a few bytes per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import run_world
from _parity import assert_close

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # 2k tokens on a wide model, three forwards: well over the fast tier's 20 s

OUTPUTS = ("log_probs", "entropy")  # what GRPOTrainer asks its policy's head for
# A tiny-but-wide model (activations, not weights, dominate at 2k tokens): linear, linear, full, linear attention.
SHAPE = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    vocab_size=256, max_position_embeddings=4096,
)
PAD, PROMPT, COMPLETION = 5, 27, 2016  # one row of 2048 tokens: left padding, prompt, completion


def grpo_row(vocab_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """One row as GRPOTrainer's `_get_per_token_logps_and_entropies` passes it to the head:
    [left-padded prompt | completion], labels on the completion only; and `logits_to_keep`."""
    gen = torch.Generator().manual_seed(0)
    attention_mask = torch.cat([torch.zeros(1, PAD), torch.ones(1, PROMPT + COMPLETION)], dim=1).long()
    input_ids = torch.randint(1, vocab_size, attention_mask.shape, generator=gen).masked_fill(attention_mask == 0, 0)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-COMPLETION] = -100  # TRL masks the prompt
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}, COMPLETION


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    import trl.trainer.grpo_trainer as grpo_module
    from torch.distributed.device_mesh import init_device_mesh
    from trl.trainer.utils import add_fused_lm_head

    from qwen35_accel import PARALLELIZER, install
    from qwen35_accel.parallel.context_parallel.model import context_parallel_paused
    from qwen35_accel.testing.saved_tensors import saved_bytes_by_part
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    install()
    reference = build_tiny_causal_lm(seed=0, **SHAPE)
    add_fused_lm_head(reference, outputs=OUTPUTS)  # TRL's own head, one process
    model = build_tiny_causal_lm(seed=0, **SHAPE)
    grpo_module.add_fused_lm_head(model, outputs=OUTPUTS)  # as GRPOTrainer calls it
    mesh = init_device_mesh("cpu", (1, 1, world, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    PARALLELIZER.apply(model, mesh)

    batch, _ = grpo_row(SHAPE["vocab_size"])
    want, one = saved_bytes_by_part(reference, lambda: reference(**batch, fused_lm_head=True))
    got, cp = saved_bytes_by_part(model, lambda: model(**batch, fused_lm_head=True))
    for name in OUTPUTS:  # the measured forward is the right one
        assert_close(getattr(got, name).detach(), getattr(want, name).detach(), name)
    with context_parallel_paused(model):  # every rank the whole row: a replicated decoder
        _, paused = saved_bytes_by_part(model, lambda: model(**batch, fused_lm_head=True))
    fields = sum(getattr(got, name).numel() * getattr(got, name).element_size() for name in OUTPUTS)
    result = {"rank": rank, "one_process": one, "cp2": cp, "cp2_paused": paused, "gathered_field_bytes": fields}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


def test_grpo_forward_of_a_long_completion_at_cp2_keeps_half_the_activations_per_rank(tmp_path):
    out = tmp_path / "saved.json"
    run_world(_worker, 2, str(out))
    ranks = json.loads(out.read_text())
    one = ranks[0]["one_process"]["decoder"] + ranks[0]["one_process"]["head"]
    cp = max(r["cp2"]["decoder"] + r["cp2"]["head"] for r in ranks)
    paused = max(r["cp2_paused"]["decoder"] + r["cp2_paused"]["head"] for r in ranks)
    ratio, replicated = cp / one, paused / one
    print(f"\nsaved for backward per rank (MiB): one process {one / 2**20:.1f}, cp 2 {cp / 2**20:.1f} (ratio {ratio:.3f}), "
          f"cp 2 paused {paused / 2**20:.1f} (ratio {replicated:.3f}); per part: {ranks}")
    # Ideal 0.5: each rank holds half the tokens; above it, what each rank keeps of the CP
    # exchanges (chunk summaries, the full-attention layer's gathered keys and values).
    assert ratio <= 0.6, (ratio, ranks)
    # The check sees replication: whole rows on every rank keep one process's bytes.
    assert replicated >= 0.9, (replicated, ranks)
    # What TRL gets back for whole rows (log_probs, entropy: [1, 2047] fp32 each) is small
    # beside what a rank keeps: under 0.1% of its saved bytes.
    assert all(r["gathered_field_bytes"] == 2 * 4 * (PAD + PROMPT + COMPLETION - 1) for r in ranks), ranks
    assert max(r["gathered_field_bytes"] for r in ranks) < 1e-3 * cp, ranks
