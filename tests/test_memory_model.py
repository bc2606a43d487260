"""The memory model behind `plan` against what autograd really keeps for backward.

Activation and loss bytes are measured with saved-tensor hooks (distinct storages,
parameters excluded) on a tiny-but-wide Qwen3.5 under `PARALLELIZER.apply` in a gloo world
of 2: cp 1 (dp_shard 2), cp 2, tp 2, each with activation checkpointing off and on under a
bf16 policy and off in fp32 (what a CPU YAML runs: torch's rule then aliases its fp32
inputs), tp 2 with a vocab-parallel lm_head, and the tiled loss in both modes (recompute,
hold). Under checkpointing the
layers' saved tensors are recomputed, so what stays is what the checkpoint holds: the
tensors each checkpointed layer was called with (counted by a pre-hook).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from _cli import run_cli
from _dist import run_world
from qwen35_accel.testing.saved_tensors import saved_storage_bytes
from qwen35_accel.memory import (
    MemoryEstimate,
    ModelShape,
    Parallel,
    StepOptions,
    describe,
    estimate,
    loss_block,
    memory_report,
    parse_bytes,
    suggest_cp,
)

SHAPE = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48,
    linear_conv_kernel_dim=4, vocab_size=8192,
)
SEQ = 256
TOLERANCE = 0.10  # the bound: the model is for deciding what fits, not byte accounting
ACTIVATION_TOLERANCE = 0.02  # activations (the decoder's saved tensors) are counted tensor by tensor


# (layout, activation checkpointing, tiled_loss: off, recompute or hold, compute dtype: bf16 policy or fp32)
Case = tuple[str, bool, str, str]
TRANSFORMERS_LOSS_CASES: list[Case] = [(layout, ac, "off", "bf16") for layout in ("cp1", "cp2", "tp2") for ac in (False, True)]
TRANSFORMERS_LOSS_CASES.append(("tp2 vocab", True, "off", "bf16"))
# fp32 (a CPU YAML's run): the chunked rule's fp32 cast aliases its inputs; 256 tokens are whole chunks.
TRANSFORMERS_LOSS_CASES += [(layout, False, "off", "fp32") for layout in ("cp1", "cp2", "tp2")]


def _tiled_loss_cases(mode: str) -> list[Case]:
    # The loss does not depend on checkpointing: the tiled loss is measured with it on only.
    return [(layout, True, mode, "bf16") for layout in ("cp1", "cp2", "tp2", "tp2 vocab")]


def _mesh(layout: str):
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "cp1":
        return init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard_cp",))
    if layout == "cp2":
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "cp"))
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh
    return init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard_cp", "tp"))  # tp2, tp2 vocab


def _measure(layout: str, ac: bool, tiled: str, dtype: str) -> dict[str, int]:
    """{"activations", "loss"}: bytes this rank's forward keeps for backward; "parameters":
    bytes of this rank's parameter shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    mesh = _mesh(layout)
    model = build_tiny_causal_lm(seed=0, **SHAPE)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16" else None
    vocab = layout == "tp2 vocab"
    PARALLELIZER.apply(model, mesh, mp_policy=policy, activation_checkpointing=ac, vocab_parallel_lm_head=vocab, tiled_loss=tiled)
    local = {(p._local_tensor if isinstance(p, DTensor) else p) for p in model.parameters()}
    parameters = sum(t.numel() * t.element_size() for t in local)
    batch = random_batch(1, SEQ, SHAPE["vocab_size"], seed=0)
    if layout == "cp2":
        batch = shard_batch(batch, mesh["cp"])

    saved = _saved_by_part(model, batch, checkpointed=ac)
    return {**saved, "parameters": parameters}


def _saved_by_part(model: torch.nn.Module, batch: dict[str, torch.Tensor], checkpointed: bool) -> dict[str, int]:
    """Bytes of the distinct storages a forward of `model` keeps for backward (parameters
    excluded): "activations" until the decoder returns, "loss" after (lm_head, cross
    entropy). `checkpointed`: also what each checkpointed decoder layer was called with."""
    from torch.distributed.tensor import DTensor

    def parameter_storages() -> set[int]:  # as registered now (FSDP2 swaps in unsharded ones)
        return {(p._local_tensor if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in model.parameters()}

    kept: dict[int, tuple[int, str]] = {}
    phase = ["activations"]

    def keep(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in kept and storage.data_ptr() not in parameter_storages():
            kept[storage.data_ptr()] = (storage.nbytes(), phase[0])

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    def held_by_checkpoint(module, args, kwargs) -> None:
        for value in [*args, *kwargs.values()]:
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    keep(t)

    hooks = [layer.register_forward_pre_hook(held_by_checkpoint, with_kwargs=True) for layer in model.model.layers] if checkpointed else []
    hooks.append(model.model.register_forward_hook(lambda *_: phase.__setitem__(0, "loss")))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)  # what the forward keeps is all that is measured: no backward
    for hook in hooks:
        hook.remove()
    return {part: sum(n for n, p in kept.values() if p == part) for part in ("activations", "loss")}


def _world(rank: int, world: int, cases: list[Case], out: str) -> None:
    results = {_name(*case): _measure(*case) for case in cases}
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _name(layout: str, ac: bool, tiled: str, dtype: str) -> str:
    return f"{layout} ac={ac} tiled={tiled} {dtype}"


def _predicted(layout: str, ac: bool, tiled: str, dtype: str) -> MemoryEstimate:
    from qwen35_accel.testing.tiny import tiny_text_config

    parallel = {"cp1": Parallel(dp_shard=2), "cp2": Parallel(cp=2), "tp2": Parallel(tp=2),
                "tp2 vocab": Parallel(tp=2, vocab_parallel_lm_head=True)}[layout]
    options = StepOptions(seq_len=SEQ, compute_bytes=2 if dtype == "bf16" else 4, activation_checkpointing=ac, tiled_loss=tiled,
                          device="cpu")
    return estimate(ModelShape.from_config(tiny_text_config(**SHAPE)), parallel, options)


def _check_cases(cases: list[Case], tmp_path: Path) -> None:
    out = tmp_path / "measured.json"
    run_world(_world, 2, cases, str(out))
    measured = json.loads(out.read_text())
    rows, bad = [], []
    for case in cases:
        got = measured[_name(*case)]
        want = _predicted(*case)
        for part in ("activations", "loss", "parameters"):
            ratio = getattr(want, part) / got[part]
            rows.append(f"{_name(*case)} {part}: predicted {getattr(want, part)} measured {got[part]} ({ratio:.3f})")
            if abs(ratio - 1) > (ACTIVATION_TOLERANCE if part == "activations" else TOLERANCE):
                bad.append(rows[-1])
    # With pytest -s, the table (not a QWEN35_ACCEL_* name: the plugin refuses unknown ones).
    if os.environ.get("SHOW_MEMORY_MODEL_TABLE"):
        print("\n".join(rows))
    assert not bad, "\n".join(bad)


@pytest.mark.multiprocess
def test_predicted_bytes_match_measured_with_transformers_loss_in_bf16_and_fp32(tmp_path):
    _check_cases(TRANSFORMERS_LOSS_CASES, tmp_path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["recompute", "hold"])
def test_predicted_bytes_match_measured_with_tiled_loss(mode, tmp_path):
    _check_cases(_tiled_loss_cases(mode), tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predicted_bytes_match_the_unmodified_model_at_another_shape(dtype):
    """One process, Transformers' model as is: key heads = value heads (nothing repeats the
    query and key: in fp32 they stay views of the conv's output), 2 rows of a length the
    chunked rule pads, fp32 (where casts alias) and bf16."""
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch, tiny_text_config

    shape = dict(
        hidden_size=192, intermediate_size=320, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
        head_dim=32, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=2048,
    )
    rows, seq = 2, 136
    model = build_tiny_causal_lm(seed=0, dtype=dtype, **shape)
    batch = random_batch(rows, seq, shape["vocab_size"], seed=0)
    got = _saved_by_part(model, batch, checkpointed=False)
    options = StepOptions(seq_len=seq, batch_size=rows, compute_bytes=dtype.itemsize, param_bytes=dtype.itemsize, device="cpu",
                          tiled_loss="off")
    want = estimate(ModelShape.from_config(tiny_text_config(**shape)), Parallel(), options)
    for part, tolerance in (("activations", ACTIVATION_TOLERANCE), ("loss", TOLERANCE)):
        assert abs(getattr(want, part) / got[part] - 1) <= tolerance, (part, getattr(want, part), got[part])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gated_delta_net_layer_keeps_what_torch_kernels_are_predicted_to_keep(dtype):
    """One GatedDeltaNet decoder layer of the unmodified model, alone: with as many key as
    value heads or fewer (repeated), at whole chunks of the rule and at a padded length. In
    fp32 the rule's cast aliases its inputs (strided views; views of the conv's output)."""
    from qwen35_accel.memory import layer_activations
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, tiny_text_config

    for k_heads in (4, 2):
        shape = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=16, linear_num_key_heads=k_heads, linear_num_value_heads=4, linear_key_head_dim=32,
                     linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=64, layer_types=["linear_attention"])
        layer = build_tiny_causal_lm(seed=0, dtype=dtype, **shape).model.layers[0]
        for seq in (256, 136):  # 4 whole chunks; 136 padded to 192
            rows = 2
            hidden = torch.randn(rows, seq, 64, dtype=dtype, requires_grad=True)
            _, got = saved_storage_bytes(lambda: layer(hidden, position_embeddings=None), exclude=list(layer.parameters()))
            options = StepOptions(seq_len=seq, batch_size=rows, compute_bytes=dtype.itemsize, param_bytes=dtype.itemsize, device="cpu")
            want = layer_activations(ModelShape.from_config(tiny_text_config(**shape)), "linear_attention", Parallel(), options)
            assert abs(want / got - 1) <= ACTIVATION_TOLERANCE, (k_heads, seq, dtype, want, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_moe_layer_keeps_what_its_sparse_block_is_predicted_to_keep(dtype):
    """One Qwen3.5-MoE decoder layer of the unmodified model, alone (Transformers' experts loop,
    the routing its router makes): at two shapes, one where 2 × I is not the hidden size, and
    with the router's logits recorded for the load-balancing loss (kept beside the layer)."""
    from qwen35_accel.memory import activations, layer_activations
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, tiny_moe_text_config

    for moe in (dict(moe_intermediate_size=40, shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2),
                dict(moe_intermediate_size=24, shared_expert_intermediate_size=64, num_experts=6, num_experts_per_tok=3)):
        shape = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                     linear_conv_kernel_dim=4, vocab_size=64, layer_types=["linear_attention"], **moe)
        layer = build_tiny_moe_causal_lm(seed=0, dtype=dtype, **shape).model.layers[0]
        rows, seq = 2, 136
        hidden = torch.randn(rows, seq, 64, dtype=dtype, requires_grad=True)
        _, got = saved_storage_bytes(lambda: layer(hidden, position_embeddings=None), exclude=list(layer.parameters()))
        options = StepOptions(seq_len=seq, batch_size=rows, compute_bytes=dtype.itemsize, param_bytes=dtype.itemsize, device="cpu")
        config = tiny_moe_text_config(**shape)
        want = layer_activations(ModelShape.from_config(config), "linear_attention", Parallel(), options)
        assert abs(want / got - 1) <= ACTIVATION_TOLERANCE, (moe, dtype, want, got)
        config.output_router_logits = True  # + every layer's [tokens, E] logits in the compute dtype
        kept = activations(ModelShape.from_config(config), Parallel(), options) - activations(ModelShape.from_config(
            tiny_moe_text_config(**shape)), Parallel(), options)
        assert kept == rows * seq * moe["num_experts"] * dtype.itemsize


def test_moe_experts_are_held_in_the_same_shards_with_ep_and_gathered_by_the_ep_rank_only():
    """A rank holds 1/(dp_shard · cp · tp) of the routed experts with or without ep (FSDP2 shards
    dp's experts too; ep × efsdp is dp_shard × cp); ep shrinks what a layer gathers to compute."""
    from qwen35_accel.testing.tiny import build_tiny_moe_causal_lm, tiny_moe_text_config

    shape = ModelShape.from_config(tiny_moe_text_config(num_experts=8))
    options = StepOptions(seq_len=256, device="cpu", compute_bytes=4, param_bytes=4)
    dp, ep = estimate(shape, Parallel(dp_shard=8), options), estimate(shape, Parallel(dp_shard=8, ep=8), options)
    assert dp.parameters == ep.parameters and dp.optimizer_states == ep.optimizer_states
    experts = shape.expert_parameters() * 4
    assert (dp.transient - ep.transient) >= experts * 7 / 8 * 3  # the running and prefetched layers' experts
    model = build_tiny_moe_causal_lm(seed=0, num_experts=8)
    assert shape.parameters() == sum(p.numel() for p in model.parameters())


def test_suggest_ep_under_tp_names_only_the_ep_that_spans_dp_shard_x_cp():
    """ep × tp needs ep = dp_shard × cp (the experts held whole, outside FSDP2), no HSDP, and ep × tp
    dividing the experts: `--suggest` proposes nothing else."""
    from qwen35_accel.memory.report import suggest_ep
    from qwen35_accel.testing.tiny import tiny_moe_text_config

    options = StepOptions(seq_len=256, device="cpu", compute_bytes=4, param_bytes=4)
    roomy = 1 << 40
    eight = ModelShape.from_config(tiny_moe_text_config(num_experts=8))
    assert suggest_ep(eight, Parallel(dp_shard=4, tp=2), options, roomy) == 4  # not 2: that leaves copies to shard
    assert suggest_ep(eight, Parallel(dp_shard=2, tp=2), options, roomy) == 2
    assert suggest_ep(eight, Parallel(dp_replicate=2, dp_shard=2, tp=2), options, roomy) is None
    assert suggest_ep(ModelShape.from_config(tiny_moe_text_config(num_experts=6)), Parallel(dp_shard=2, tp=2), options, roomy) is None
    assert suggest_ep(eight, Parallel(dp_shard=4), options, roomy) == 2


def _measured_loss_peak(mode: str, dtype: torch.dtype, tokens: int, hidden: int, vocab: int, block: tuple[int, int]) -> int:
    """Peak bytes of one lm_head + cross entropy step (forward, backward) above what existed
    before it: every tensor's storage from allocation to release (torch's MemTracker). The
    hidden states are made inside, as the decoder's output would be."""
    import torch.nn.functional as F

    from qwen35_accel.parallel.tiled_head import linear_cross_entropy_sum
    from qwen35_accel.testing.saved_tensors import peak_bytes_above

    g = torch.Generator().manual_seed(0)
    base = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)

    def step() -> None:
        hidden_states = base * 1.0
        if mode == "off":  # Transformers' loss: whole logits, upcast
            loss = F.cross_entropy(F.linear(hidden_states, weight).float(), targets, reduction="sum")
        else:
            loss = linear_cross_entropy_sum(hidden_states, weight, None, targets, tile=block[0], vocab_tile=block[1], mode=mode)
        del hidden_states
        (0.5 * loss).backward()

    return peak_bytes_above(step, [base, weight, targets])[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["off", "recompute", "hold"])
def test_predicted_loss_peak_matches_measured_within_10_percent(mode, dtype):
    """`loss_saved + loss_transient` (what the loss keeps plus its working bytes and the
    gradients it hands back) against the measured peak of the loss path, in fp32 and bf16:
    blocks of 512 tokens × 1024 vocab rows at vocab 8192 (a block's fp32 logits as large as
    the weight's fp32 gradient, so both terms are tested)."""
    from qwen35_accel.memory import loss_saved, loss_transient
    from qwen35_accel.testing.tiny import tiny_text_config

    tokens, hidden, vocab = 512, 64, 8192
    shape = ModelShape.from_config(tiny_text_config(**{**SHAPE, "hidden_size": hidden, "vocab_size": vocab}))
    options = StepOptions(seq_len=tokens, compute_bytes=dtype.itemsize, param_bytes=dtype.itemsize, device="cpu",
                          tiled_loss=mode, loss_tile_bytes=tokens * 1024 * 4)
    assert loss_block(tokens, vocab, options.loss_tile_bytes) == (tokens, 1024)
    predicted = loss_saved(shape, Parallel(), options) + loss_transient(shape, Parallel(), options)
    measured = _measured_loss_peak(mode, dtype, tokens, hidden, vocab, (tokens, 1024))
    assert abs(predicted / measured - 1) <= TOLERANCE, f"{mode} {dtype}: predicted {predicted}, measured {measured}"


def _27b_like() -> ModelShape:
    """The 27B-like shape of tests/test_cli.py (3 GatedDeltaNet layers per attention layer)."""
    return ModelShape(hidden=5120, intermediate=17408, vocab=248320, linear_layers=48, full_layers=16, heads=24,
                      kv_heads=4, head_dim=256, rotary_dim=64, k_heads=16, v_heads=48, k_dim=128, v_dim=128, conv_kernel=4)


def test_memory_sizes_parse_with_units_and_bad_ones_say_what_to_pass():
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("139.5 GiB") == int(139.5 * 2**30)
    assert parse_bytes("80000MB") == 80 * 10**9 and parse_bytes("4096") == 4096
    for bad in ("-1", "0GB", "lots", "12 XB", ""):
        with pytest.raises(ValueError, match="pass a positive number with a unit"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="adamw, sgd, none"):
        StepOptions(seq_len=8, optimizer="adam")


def test_loss_blocks_hold_at_most_256_MiB_of_fp32_logits_and_up_to_4096_tokens():
    assert loss_block(32768, 248320) == (4096, 16384)  # 2**28 / (4 · 4096) rows, a multiple of 8
    assert loss_block(264, 248320) == (264, 248320)  # the whole vocab fits beside 264 tokens
    assert loss_block(100, 1000) == (100, 1000)  # never more tokens than the step has
    assert loss_block(10**6, 10**9) == (4096, 16384)


def test_suggested_cp_is_the_smallest_that_fits():
    shape, options = _27b_like(), StepOptions(seq_len=131072, tiled_loss="recompute")
    gpu = parse_bytes("141GB")
    cp = suggest_cp(shape, Parallel(dp_shard=8), options, gpu)
    assert cp is not None and cp > 1
    checkpointed = StepOptions(seq_len=131072, activation_checkpointing=True)
    assert estimate(shape, Parallel(dp_shard=8 // cp, cp=cp), checkpointed).total <= gpu
    smaller = max(c for c in (1, 2, 4, 8) if c < cp)
    assert estimate(shape, Parallel(dp_shard=8 // smaller, cp=smaller), checkpointed).total > gpu
    assert suggest_cp(shape, Parallel(dp_shard=8), options, parse_bytes("10GB")) is None
    keys = estimate(shape, Parallel(dp_shard=8), options).as_dict()
    assert list(keys) == ["parameters", "gradients", "optimizer_states", "activations", "loss", "transient",
                          "reference_parameters", "host_activations", "total"]
    assert keys["total"] == sum(v for k, v in keys.items() if k not in ("total", "host_activations"))  # the device's



def test_a_layers_forward_flops_are_its_matmuls_and_its_sequence_mixers_counted_by_hand():
    """`layer_forward_flops` on a shape small enough to count by hand (cp 2: 32 of 64 tokens per rank)."""
    from qwen35_accel.memory import layer_forward_flops

    shape = ModelShape(hidden=8, intermediate=16, vocab=32, linear_layers=1, full_layers=1, heads=2, kv_heads=1, head_dim=4,
                       rotary_dim=4, k_heads=1, v_heads=2, k_dim=4, v_dim=4, conv_kernel=4)
    options, tokens = StepOptions(seq_len=64), 32
    mlp = 3 * 8 * 16
    # GatedDeltaNet: in_proj_qkv (conv_dim 2·4 + 2·4 = 16) 16·8, z 8·8, b and a 2·2·8, conv taps 16·4, gate holder 2·2, out_proj 8·8.
    linear = mlp + 16 * 8 + 8 * 8 + 2 * 2 * 8 + 16 * 4 + 2 * 2 + 8 * 8
    chunk_rule = 2 * (4 * 64 * (4 + 4) + 6 * 4 * 4)  # 2 value heads: in-chunk products, the state's reads and update
    assert layer_forward_flops(shape, "linear_attention", Parallel(cp=2), options) == tokens * (2 * linear + chunk_rule) == 184576
    # Attention: q_proj (query and gate) 2·8·8, k and v 2·4·8, o_proj 8·8; causal Q·Kᵀ and P·V over seq / 2 keys on average.
    attention = mlp + 2 * 8 * 8 + 2 * 4 * 8 + 8 * 8
    scores = 2 * 2 * (64 // 2) * 4 * 2  # 2 products x 2 FLOPs per multiply-add x seq / 2 keys x head_dim x 2 heads
    assert layer_forward_flops(shape, "full_attention", Parallel(cp=2), options) == tokens * (2 * attention + scores) == 73728
    # tp 2 halves every term (the heads and the MLP are split).
    assert layer_forward_flops(shape, "full_attention", Parallel(cp=2, tp=2), options) == 73728 // 2


def test_offload_copies_are_hidden_when_the_compute_they_overlap_takes_longer():
    """The copy to the host overlaps the forward of the layer reading that input, the copy back the
    recompute and backward (3 forwards) of the layer above: hidden or not against the cheaper kind."""
    from qwen35_accel.memory import offload_timing

    shape = ModelShape(hidden=8, intermediate=16, vocab=32, linear_layers=1, full_layers=1, heads=2, kv_heads=1, head_dim=4,
                       rotary_dim=4, k_heads=1, v_heads=2, k_dim=4, v_dim=4, conv_kernel=4)
    options = StepOptions(seq_len=64, activation_checkpointing=True, activation_offload=True)  # bf16: 32 tokens x 8 x 2 bytes
    # 73728 FLOPs per second: the attention layer's forward (the cheaper kind) takes 1 s.
    for link, to_host, back in ((1024, True, True), (204.8, False, True), (128, False, False)):  # 0.5 s, 2.5 s, 4 s
        timing = offload_timing(shape, Parallel(cp=2), options, host_link_bytes_per_s=link, device_flops_per_s=73728 * 2, mfu=0.5)
        assert timing["bytes_per_layer"] == 512 and timing["seconds_per_layer_each_way"] == 512 / link
        assert timing["forward_seconds_per_layer"] == {"linear_attention": 184576 / 73728, "full_attention": 1.0}
        assert (timing["copy_to_host_hidden"], timing["copy_back_hidden"]) == (to_host, back), (link, timing)
    lines = describe(memory_report(shape, Parallel(cp=2), options), gpus=2)
    assert any(line.startswith("  offload against compute: a layer's forward ") and "989 TFLOP/s dense peak (H100/H200) x 40% MFU" in line
               and "copy to the host NOT hidden" in line for line in lines), lines  # 512 bytes take longer than 74 kFLOPs

def _plan(*args: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    config = str(root / "accelerate_configs" / "cpu_fsdp2_dp2_cp2.yaml")
    return run_cli("plan", "--model", "tiny", "--config", config, *args)  # in this process (tests/_cli.py)


def test_plan_json_says_whether_it_fits_and_suggests_a_cp():
    run = _plan("--seq-len", "1024", "--gpu-memory", "141GB", "--suggest", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    p = json.loads(run.stdout)
    memory = p["memory_per_rank"]
    assert all(isinstance(v, int) for v in memory.values()) and memory["host_activations"] == 0
    assert memory["total"] == sum(memory.values()) - memory["total"]
    assert p["fits"] and p["margin_bytes"] == 141 * 10**9 - memory["total"] and p["suggested_cp"] == 1
    # The parameter bytes agree with the FSDP2 units the plan lays out (max over ranks: ±1 %).
    assert abs(memory["parameters"] / p["bytes_per_rank_max"] - 1) < 0.01
    # A CPU YAML (use_cpu: true) plans the CPU run: gloo, torch's GatedDeltaNet kernels.
    assert p["run"] == {"device": "cpu", "backend": "gloo", "kernels": "torch", "source": "the YAML: use_cpu: true"}
    assert p["memory_assumptions"]["device"] == "cpu" and p["memory_assumptions"]["seq_len"] == 1024
    small = _plan("--seq-len", "1024", "--gpu-memory", "1MiB")
    assert small.returncode == 0 and "does not fit in 1.00 MiB" in small.stdout, small.stderr[-3000:]


@pytest.mark.parametrize("parallel", [Parallel(dp_shard=8), Parallel(dp_shard=2, cp=2, tp=2),
                                      Parallel(dp_shard=4, tp=2, vocab_parallel_lm_head=True)], ids=["dp8", "dp2xcp2xtp2", "dp4xtp2-vocab"])
@pytest.mark.parametrize("compute_bytes,param_bytes,reference_bytes", [(2, 4, 2), (2, 4, 4), (4, 4, 4)],
                         ids=["bf16-policy-bf16-checkpoint", "bf16-policy-fp32-checkpoint", "fp32"])
def test_a_reference_model_adds_its_parameter_shards_and_nothing_else(parallel, compute_bytes, param_bytes, reference_bytes):
    """A frozen copy of the policy (TRL's ref_model) is sharded as the policy's parameters are
    (the same FSDP2 units and tp split) in its checkpoint's dtype (no fp32 masters: the plugin
    keeps a frozen model's dtype); no gradients, optimizer state, activations or transient of its own."""
    shape = _27b_like()
    options = StepOptions(seq_len=32768, compute_bytes=compute_bytes, param_bytes=param_bytes)
    alone = estimate(shape, parallel, options)
    both = estimate(shape, parallel, StepOptions(seq_len=32768, compute_bytes=compute_bytes, param_bytes=param_bytes,
                                                 reference_model=True, reference_bytes=reference_bytes))
    held = alone.parameters * reference_bytes // param_bytes
    assert alone.reference_parameters == 0 and both.reference_parameters == held > 0
    assert both.as_dict() == {**alone.as_dict(), "reference_parameters": held, "total": alone.total + held}


def test_plan_counts_the_reference_model_with_ref_model():
    """`--ref-model`: `reference_model` in --json (the policy's units and bytes per rank, no
    gradients), `memory_per_rank["reference_parameters"]` in the total, and the text names it."""
    runs = {flag: _plan("--seq-len", "1024", "--json", *flag) for flag in ((), ("--ref-model",))}
    assert all(r.returncode == 0 for r in runs.values()), [r.stderr[-3000:] for r in runs.values()]
    alone, both = (json.loads(r.stdout) for r in runs.values())
    assert alone["reference_model"] is None and alone["memory_per_rank"]["reference_parameters"] == 0
    reference, memory = both["reference_model"], both["memory_per_rank"]
    assert reference["bytes_per_rank_max"] == both["bytes_per_rank_max"] == alone["bytes_per_rank_max"]
    assert reference["gradients"] == reference["optimizer_states"] == reference["activations"] == 0
    assert memory["reference_parameters"] == reference["memory_bytes_per_rank"] == memory["parameters"]
    assert memory["total"] == alone["memory_per_rank"]["total"] + memory["parameters"]
    assert both["memory_assumptions"]["reference_model"] is True
    text = _plan("--seq-len", "1024", "--ref-model")
    assert text.returncode == 0, text.stderr[-3000:]
    assert "reference model (frozen copy, e.g. TRL's ref_model): the same units" in text.stdout, text.stdout
    assert "reference model (--ref-model): a frozen copy in the policy's FSDP2 units" in text.stdout, text.stdout


def test_plans_of_other_world_sizes_in_one_process_leave_no_group_and_a_job_of_another_size_is_refused():
    """`plan()` lays the model out over a fake process group of the YAML's world size and removes
    it: plans of 2 and 4 processes one after the other in one process (a notebook comparing
    layouts), and none left behind. Inside a job of another size: refused, naming both sizes."""
    import torch.distributed as dist

    from qwen35_accel.plan import PlanError, plan

    configs = Path(__file__).resolve().parents[1] / "accelerate_configs"
    two, four = (plan("tiny", str(configs / name), seq_len=64) for name in ("cpu_fsdp2.yaml", "cpu_fsdp2_dp2_cp2.yaml"))
    assert (two["mesh"]["world"], four["mesh"]["world"]) == (2, 4) and not dist.is_initialized()
    assert two["fsdp_shards"] == 2 and four["fsdp_shards"] == 4
    dist.init_process_group("fake", rank=1, world_size=3)
    try:
        with pytest.raises(PlanError, match=r"the YAML describes 2 processes, but this process is rank 1 of a process group of 3"):
            plan("tiny", str(configs / "cpu_fsdp2.yaml"), seq_len=64)
        assert dist.is_initialized()  # not ours to remove
    finally:
        dist.destroy_process_group()


def test_a_bf16_checkpoints_reference_holds_bf16_under_a_bf16_policy(tmp_path):
    """The policy's units hold fp32 masters under `mixed_precision: bf16`; a frozen reference of
    a bf16 checkpoint keeps bf16 (tests/test_accelerate_plugin.py prepares one so): half the
    policy's bytes but for the fp32 gate holders, in the units and in the memory."""
    from qwen35_accel.model.tiny import tiny_text_config

    config = tiny_text_config()
    config.dtype = "bfloat16"
    config.save_pretrained(tmp_path)
    yaml = str(Path(__file__).resolve().parents[1] / "accelerate_configs" / "fsdp2.yaml")
    run = run_cli("plan", "--model", str(tmp_path), "--config", yaml, "--seq-len", "1024", "--json", "--ref-model")
    assert run.returncode == 0, run.stderr[-3000:]
    planned = json.loads(run.stdout)
    units = [u for layer in planned["layers"] for u in layer["units"]] + planned["other_units"]
    holders = sum(u["bytes_per_rank_max"] for u in units if all(m.endswith("._fp32_params") for m in u["modules"]))
    assert 0 < holders < planned["bytes_per_rank_max"]
    assert planned["reference_model"]["bytes_per_rank_max"] == (planned["bytes_per_rank_max"] - holders) // 2 + holders
    memory = planned["memory_per_rank"]
    assert memory["reference_parameters"] == memory["parameters"] // 2 > 0


@pytest.mark.parametrize("args, message", [
    (("--gpu-memory", "-1"), "--gpu-memory '-1' is not a memory size"),
    (("--suggest",), "--suggest needs --gpu-memory"),
    (("--optimizer", "adam"), "optimizer 'adam' is not one of adamw, sgd, none"),
    (("--batch-size", "0"), "batch_size 0"),
])
def test_plan_refuses_bad_memory_options_in_one_line(args, message):
    run = _plan(*args)
    assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
