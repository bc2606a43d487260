"""Context parallelism at model level: PARALLELIZER.apply with cp > 1 equals the
single-process Transformers model (fp32: loss, every gradient, gathered logits)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_world
from _parity import assert_close, assert_grads_match, eval_logits
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

pytestmark = pytest.mark.multiprocess


def cp_mesh(world: int, cp: int):
    """Accelerate's mesh layout: (dp_replicate, dp_shard, cp, tp) + flattened dp_shard_cp."""
    mesh = init_device_mesh("cpu", (1, world // cp, cp, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def _padded_batch(rows: int, seq: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Random tokens, labels = input_ids, the last row right-padded by 5 tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, seq), generator=gen)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[-1, seq - 5 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _cp_parity_worker(
    rank: int, world: int, cp: int, seq: int, padded: bool, activation_checkpointing: bool, attention: str = "sdpa"
) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import gather_sequence, shard_batch
    from qwen35_accel.parallel.context_parallel.attention import (
        ContextParallelAttention,
    )
    from qwen35_accel.parallel.context_parallel.gated_delta_net import (
        ContextParallelGatedDeltaNet,
    )
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    dp = world // cp
    rows_per_replica = 2
    reference = build_tiny_causal_lm(seed=0)
    model = build_tiny_causal_lm(seed=0)
    for m in (reference, model):
        m.config._attn_implementation = attention
    mesh = cp_mesh(world, cp)
    PARALLELIZER.apply(model, mesh, activation_checkpointing=activation_checkpointing)
    assert isinstance(model.model.layers[0].linear_attn, ContextParallelGatedDeltaNet)
    assert isinstance(model.model.layers[2].self_attn, ContextParallelAttention)

    vocab = reference.config.vocab_size
    if padded:
        batch = _padded_batch(rows_per_replica * dp, seq, vocab, seed=7)
    else:
        batch = random_batch(rows_per_replica * dp, seq, vocab, seed=7)
    replica = mesh["dp_shard"].get_local_rank()
    rows = slice(replica * rows_per_replica, (replica + 1) * rows_per_replica)
    replica_batch = {k: v[rows] for k, v in batch.items()}

    ref_out = reference(**batch)
    ref_out.loss.backward()
    ref_replica_logits = reference(**replica_batch).logits.detach()

    local = shard_batch(replica_batch, mesh["cp"])
    # An eval forward (no autograd) returns logits; run before the training forward, whose
    # tiled loss returns none (an FSDP2 forward without backward leaves no-reshard units gathered).
    logits = gather_sequence(eval_logits(model, local), mesh["cp"])[:, :seq]
    out = model(**local)
    out.loss.backward()

    # Every rank reports its cp group's mean; dp replicas hold equal token counts here.
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp_shard"].get_group())
    assert_close(loss, ref_out.loss.detach(), "loss")
    assert assert_grads_match(model, reference) == sum(1 for _ in reference.parameters())
    assert out.logits is None  # the tiled loss: no [tokens, vocab] in a training forward
    # Real tokens only: a padded query's output is not defined (Transformers masks padded
    # keys for it, CP does not need to), and padded tokens carry no loss.
    real = replica_batch.get("attention_mask", torch.ones(rows_per_replica, seq)).bool()
    assert_close(logits[real], ref_replica_logits[real], "gathered logits")


@pytest.mark.parametrize(
    "world,cp,seq,padded,ac,attention",
    [
        pytest.param(2, 2, 30, True, False, "sdpa", marks=pytest.mark.slow),  # padded to 32 (2·cp divides), right padding inside the batch
        (2, 2, 32, False, True, "eager"),  # AC: the recompute repeats the collectives; eager attention
        pytest.param(4, 4, 32, False, False, "sdpa", marks=pytest.mark.slow),  # local chunks of 4 tokens: the conv halo spans one chunk
        pytest.param(4, 2, 32, False, False, "sdpa", marks=pytest.mark.slow),  # dp 2 × cp 2
    ],
    ids=["cp2-padded", "cp2-ac-eager", "cp4", "dp2xcp2"],
)
def test_cp_loss_grads_and_logits_match_single_process(world, cp, seq, padded, ac, attention) -> None:
    run_world(_cp_parity_worker, world, cp, seq, padded, ac, attention)


def _cp_bf16_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    reference = build_tiny_causal_lm(seed=0)
    model = build_tiny_causal_lm(seed=0)
    mesh = cp_mesh(world, world)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    PARALLELIZER.apply(model, mesh, mp_policy=policy)
    seen = []
    for layer in model.model.layers:
        if layer.block_type == "linear_attention":
            holder = layer.linear_attn._fp32_params
            holder.register_forward_hook(lambda m, a, o: seen.append((m.A_log.dtype, m.dt_bias.dtype, o.dtype)))
            layer.linear_attn.in_proj_qkv.register_forward_hook(lambda m, a, o: seen.append((m.weight.dtype,)))
    batch = random_batch(2, 32, reference.config.vocab_size, seed=3)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    loss = model(**shard_batch(batch, mesh["cp"])).loss
    loss.backward()
    assert (torch.float32, torch.float32, torch.float32) in seen and (torch.bfloat16,) in seen
    # bf16 compute (8 mantissa bits: 3.9e-3 per rounding) through 3 layers against the fp32 reference: a loss within 2e-2.
    assert_close(loss.detach(), ref_loss.detach(), "bf16 loss", rtol=2e-2, atol=2e-2)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad.full_tensor()).all(), name


@pytest.mark.slow  # cp2-ac-eager is the fast tier's CP model test
def test_cp_bf16_policy_within_bf16_tolerance_gate_in_fp32():
    run_world(_cp_bf16_worker, 2)


def _cp_bad_input_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    from qwen35_accel.parallel.context_parallel.chunks import shard_sequence

    mesh = cp_mesh(world, world)
    with pytest.raises(ValueError, match=r"cp_state_exchange='ring'; expected one of \('auto', 'allgather', 'scan'\)"):
        PARALLELIZER.apply(build_tiny_causal_lm(seed=0), cp_mesh(world, world), cp_state_exchange="ring")
    model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh, cp_state_exchange="allgather")
    assert {m.state_exchange for m in model.modules() if hasattr(m, "state_exchange")} == {"allgather"}
    batch = random_batch(2, 16, model.config.vocab_size, seed=0)
    positions = torch.arange(16).expand(2, 16)

    def local(t):
        return shard_sequence(t, world, rank)

    ids = local(batch["input_ids"])
    with pytest.raises(ValueError, match="shift_labels"):  # labels cannot be shifted inside a chunk
        model(input_ids=ids, labels=local(batch["labels"]), position_ids=local(positions))
    with pytest.raises(ValueError, match="position_ids"):  # the model would number local tokens from 0
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"local length is 7 \(odd\)"):
        model(input_ids=ids[:, :7])
    with pytest.raises(NotImplementedError, match="cache"):
        model(input_ids=ids, cache=object())
    # Left padding: rank 0 sees it locally, the other ranks only through the shared check;
    # every rank must raise (none may go on into a collective alone).
    left = torch.ones(2, 16, dtype=torch.long)
    left[1, :3] = 0
    with pytest.raises(ValueError, match="right padding only"):
        model(input_ids=ids, position_ids=local(positions), attention_mask=local(left))
    # A hole exactly at a chunk boundary (chunk 1 padded, chunk 2 real): only the boundary check sees it.
    hole = torch.ones(2, 16, dtype=torch.long)
    hole[0, 4:8] = 0
    with pytest.raises(ValueError, match="right padding only"):
        model(input_ids=ids, position_ids=local(positions), attention_mask=local(hole))
    # Packed rows whose forms disagree (positions restart at 8, cu_seq_lens at 6): every
    # rank raises, also those whose own tokens hold no boundary of either form.
    packed = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, 16)
    cu = torch.tensor([0, 6, 16, 22, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match="position_ids and cu_seq_lens_q describe different document boundaries"):
        model(input_ids=ids, position_ids=local(packed), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must start at 0 and end at .* \(2 x 16 = 32\)"):  # a sharded one
        model(input_ids=ids, position_ids=local(packed), cu_seq_lens_q=torch.tensor([0, 8, 16], dtype=torch.int32))
    # Each rank its own batch (a framework's sampler splitting by process, not by data-parallel rank): right-padded
    # rows of other lengths on each rank (44 and 36: the Trainer's padding to 2·cp of 41 and 34 tokens). Named as
    # what it is on every rank, not as left padding.
    length = 44 if rank == 0 else 36
    mine = torch.ones(2, length, dtype=torch.long)
    mine[:, length - 3:] = 0
    own = {"input_ids": random_batch(2, length, model.config.vocab_size, seed=rank)["input_ids"],
           "position_ids": torch.arange(length).expand(2, length), "attention_mask": mine}
    with pytest.raises(ValueError, match=r"were given different batches \(local lengths \[22, 18\] on its ranks 0..1, 2 rows"):
        model(**{key: shard_sequence(value, world, rank) for key, value in own.items()})
    # And the good case still runs after the refusals (no collective was left pending).
    right = torch.ones(2, 16, dtype=torch.long)
    right[1, 13:] = 0
    out = model(input_ids=ids, position_ids=local(positions), attention_mask=local(right))
    assert out.logits.shape[1] == 16 // world

    eager = build_tiny_causal_lm(seed=0)
    eager.config._attn_implementation = "flash_attention_2"
    with pytest.raises(NotImplementedError, match=r"attn_implementation in \('sdpa', 'eager'\).*'flash_attention_2'"):
        PARALLELIZER.apply(eager, cp_mesh(world, world))


def test_cp_rejects_what_it_cannot_compute_exactly():
    run_world(_cp_bad_input_worker, 2)


def _layer_comm_worker(rank: int, world: int) -> None:
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.parallel.context_parallel.model import install_context_parallel
    from qwen35_accel.testing.tiny import build_tiny_causal_lm
    from test_cp_ops import _comm_elements

    model = build_tiny_causal_lm(seed=0)
    install_fp32_gate(model)
    install_context_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))  # no FSDP: CP traffic only
    layer = model.model.layers[0].linear_attn
    layer.state_exchange = "allgather"  # the sizes below are the all-gather's (the scan: tests/test_cp_ops.py)
    measured = {}
    for seq in (256, 2048):
        hidden = torch.randn(1, seq // world, model.config.hidden_size, generator=torch.Generator().manual_seed(rank))
        hidden.requires_grad_()
        out = {}
        forward = _comm_elements(lambda: out.update(y=layer(hidden)))
        backward = _comm_elements(lambda: out["y"].sum().backward())
        measured[seq] = (forward, backward)
    # The whole layer (conv halo + state summaries), forward and backward: same traffic at 256 and 2048 tokens.
    assert measured[256] == measured[2048], measured
    forward, _ = measured[256]
    heads, k_dim, v_dim = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    halo = 2 * layer.conv_dim * (layer.conv_kernel_size - 1)
    assert sorted(n for _, n in forward) == sorted([halo, 2 * heads * k_dim * (k_dim + v_dim)]), forward


@pytest.mark.slow  # a 2048-token layer forward and backward; test_cp_ops checks the exchange's traffic
def test_gated_delta_net_layer_cp_traffic_is_the_same_at_256_and_2048_tokens():
    run_world(_layer_comm_worker, 2)
