"""The FLA branches, run: FLA's Triton kernels on CPU tensors through Triton's interpreter
(`qwen35_accel.testing.interpreted_kernels`), every one against the one-process torch-kernel
oracle (the unmodified Transformers model with Transformers' torch functions), loss and
gradients. Kernel selection is the product's own (`ops.kernels.takes_kernel` admits CPU tensors
here); `launches()` shows which Triton kernels each path reached.

Runs where the `kernels-cpu` extra is installed and `TRITON_INTERPRET=1` was set at start
(`TRITON_INTERPRET=1 python3 -m pytest -m kernels`, CI's third step); skipped elsewhere.
Shapes are tiny: the interpreter runs each kernel program as Python. bf16: FLA's conv only —
Triton 3.9's interpreter stores bf16 as uint16 and multiplies those integers in `tl.dot`, so
FLA's rule in bf16 returns garbage there (values ~1e9); bf16 of the rule is a GPU check
(`benchmarks/cuda_check.py`).

Tolerances: fp32 rtol 1e-5 / atol 1e-6 as everywhere, except where a comment says why: FLA's
chunked rule sums in other blocks than Transformers' torch rule (both fp32).
"""

from __future__ import annotations

import pytest
import torch

from _parity import assert_close, documents_alone, hf_name
from qwen35_accel.testing import interpreted_kernels as ik

pytestmark = [pytest.mark.kernels, pytest.mark.skipif(ik.unavailable() is not None, reason=f"{ik.unavailable()}")]

# Triton kernels each path must reach (names of FLA 0.6's kernels).
RULE_FORWARD = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
RULE_BACKWARD = "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"
CONV_FORWARD, CONV_BACKWARD = "causal_conv1d_fwd_kernel", "causal_conv1d_bwd_kernel"
RECURRENT = "fused_recurrent_gated_delta_rule_fwd_kernel"
# Every document case of the conv window and of the chunked rule at a boundary (64-token chunks).
LENGTHS = [70, 3, 1, 22]


@pytest.fixture(autouse=True, scope="module")
def _interpreted():
    ik.install()


def _grad_gap(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference relative to the largest reference value."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


def _assert_model_grads(model, reference, atol: float = 1e-6) -> None:
    """Every gradient equals the reference's (FSDP2's DTensors and TP's slices gathered)."""
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel

    ref = dict(reference.named_parameters())
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert len(names) == sum(1 for p in reference.parameters() if p.requires_grad)
    for name in names:
        grad = gather_tensor_parallel(model, name, dict(model.named_parameters())[name].grad)
        assert_close(grad, ref[hf_name(name)].grad, f"grad of {name}", atol=atol)


def _rule_inputs(seq: int, dtype: torch.dtype = torch.float32, batch: int = 1):
    gen = torch.Generator().manual_seed(seq)
    k_heads, v_heads, dim = 2, 4, 16  # GQA: 2 value heads per key head
    q = torch.randn(batch, seq, k_heads, dim, generator=gen)
    k = torch.randn(batch, seq, k_heads, dim, generator=gen)
    v = torch.randn(batch, seq, v_heads, dim, generator=gen)
    g = -torch.empty(batch, seq, v_heads).uniform_(0.002, 0.05, generator=gen)  # weak decay: the state carries
    beta = torch.rand(batch, seq, v_heads, generator=gen)
    state = torch.randn(batch, v_heads, dim, dim, generator=gen)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)] + [t.requires_grad_() for t in (g, beta, state)]


def _run_rule(kernel, q, k, v, g, beta, state, **kwargs):
    out, final = kernel(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, **kwargs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    ((out.float() * weights).sum() + final.float().square().sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v, g, beta, state)]
    for t in (q, k, v, g, beta, state):
        t.grad = None
    return out.detach(), final.detach(), grads


def test_fla_rule_equals_the_torch_kernel_with_grouped_heads_a_state_and_documents():
    from qwen35_accel.ops.gated_delta import fla_kernel, select_kernel, torch_kernel

    fla = select_kernel(torch.device("cpu"))  # the product's selection: FLA for CPU tensors here
    assert fla is fla_kernel() and fla is not torch_kernel()
    inputs = _rule_inputs(100)  # two chunks of 64, the second partial
    with ik.launches() as names:
        got = _run_rule(fla, *inputs)
    assert RULE_FORWARD in names and RULE_BACKWARD in names
    want = _run_rule(torch_kernel(), *inputs)
    for what, a, b in [("output", got[0], want[0]), ("final state", got[1], want[1])] + list(
        zip(("dq", "dk", "dv", "dg", "dbeta", "dstate"), got[2], want[2])
    ):
        # rtol 1e-5, atol 2e-5: FLA's blocked fp32 sums against the torch rule's (gaps ~1e-6 of the largest value).
        assert_close(a, b, what, atol=2e-5)

    # Documents in one row (`cu_seqlens`, what packed rows hand FLA): each equals itself alone.
    q, k, v, g, beta, _ = _rule_inputs(sum(LENGTHS))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    with torch.no_grad():
        out, _ = fla(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone, _ = torch_kernel()(*(t[:, start:end] for t in (q, k, v)), g=g[:, start:end], beta=beta[:, start:end],
                                      use_qk_l2norm_in_kernel=True)
            assert_close(out[:, start:end], alone, f"document {start}:{end}", atol=2e-5)


def test_the_comparison_fails_for_a_wrong_head_mapping_or_a_missing_state():
    """What the parity tests catch: q/k tiled to the value heads in the wrong order (FLA maps
    value head h to key head h // (v_heads / k_heads)), or the initial state dropped."""
    from qwen35_accel.ops.gated_delta import fla_kernel, torch_kernel

    q, k, v, g, beta, state = _rule_inputs(64)
    with torch.no_grad():
        want, _ = torch_kernel()(q, k, v, g=g, beta=beta, initial_state=state, use_qk_l2norm_in_kernel=True)
        interleaved, _ = fla_kernel()(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g=g, beta=beta,
                                      initial_state=state, use_qk_l2norm_in_kernel=True)
        tiled, _ = fla_kernel()(q.repeat(1, 1, 2, 1), k.repeat(1, 1, 2, 1), v, g=g, beta=beta, initial_state=state,
                                use_qk_l2norm_in_kernel=True)
        stateless, _ = fla_kernel()(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert _grad_gap(interleaved, want) < 1e-5  # value heads handed key heads in FLA's order: the same rule
    assert _grad_gap(tiled, want) > 1e-2 and _grad_gap(stateless, want) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_conv_kernel_equals_the_torch_conv_with_and_without_documents(dtype):
    from qwen35_accel.ops.causal_conv import fla_conv_kernel, select_conv_kernel, torch_conv_kernel

    assert select_conv_kernel(torch.device("cpu")) is fla_conv_kernel  # no causal-conv1d: FLA's conv is next
    gen = torch.Generator().manual_seed(0)
    channels, n = 24, sum(LENGTHS)
    x = torch.randn(2, n, channels, generator=gen).to(dtype).transpose(1, 2).requires_grad_()  # channel-last, as the layer's
    weight = torch.randn(channels, 4, generator=gen).requires_grad_()
    bias = torch.randn(channels, generator=gen).requires_grad_()
    starts = torch.zeros(2, n, dtype=torch.long)
    starts[0, torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist()])] = 1
    starts[1, torch.tensor([0, 5, 6, 40])] = 1
    seq_idx = (starts.cumsum(1) - 1).to(torch.int32)
    for documents in (None, seq_idx):
        results = []
        for kernel in (fla_conv_kernel, torch_conv_kernel):
            with ik.launches() as names:
                out = kernel(x, weight, bias, seq_idx=documents, activation="silu")
                (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
            results.append([out.detach(), x.grad, weight.grad, bias.grad])
            x.grad = weight.grad = bias.grad = None
            if kernel is fla_conv_kernel:
                assert CONV_FORWARD in names and CONV_BACKWARD in names
        for what, a, b in zip(("output", "dx", "dweight", "dbias"), *results):
            if dtype == torch.float32:
                # atol 1e-5 on values up to ~20: dweight/dbias sum ~200 products in FLA's blocks, not conv1d's order.
                assert_close(a, b, f"{what} (documents: {documents is not None})", atol=1e-5)
            else:  # bf16 x: FLA accumulates in fp32, torch's conv in the weight's fp32 too; outputs round to bf16
                assert _grad_gap(a, b) < 1e-2, what
    # The documents as offsets over the flattened rows (what the packed layer hands over, no seq_idx):
    # row 0's documents, then row 1's at 0, 5, 6, 40, each row starting one.
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist(), n, n + 5, n + 6, n + 40, 2 * n])
    by_offsets = fla_conv_kernel(x, weight, bias, cu_seqlens=offsets.to(torch.int32), activation="silu")
    assert torch.equal(by_offsets, fla_conv_kernel(x, weight, bias, seq_idx=seq_idx, activation="silu"))
    assert not torch.equal(by_offsets, fla_conv_kernel(x, weight, bias, activation="silu"))
    with pytest.raises(ValueError, match="not both"):
        fla_conv_kernel(x, weight, bias, seq_idx=seq_idx, cu_seqlens=offsets, activation="silu")


@pytest.mark.parametrize("vlm", [False, True], ids=["causal_lm", "vlm_text_path"])
def test_the_layer_through_transformers_functions_equals_the_torch_oracle(vlm):
    """Our fp32-gate layer without CP calls Transformers' kernel functions, which with FLA
    installed are FLA's (the rule), and FLA's Triton conv: a Trainer's forward (default
    kwargs: use_cache stays True) equals the unmodified model on Transformers' torch functions,
    in the causal LM and on the VLM's text path (an image in every row)."""
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_vlm, random_batch, random_vlm_batch

    build = build_tiny_vlm if vlm else build_tiny_causal_lm
    reference, model = build(seed=0), build(seed=0)
    install_fp32_gate(model)
    config = reference.config
    batch = random_vlm_batch(config, 2, 24, seed=11) if vlm else random_batch(2, 40, config.vocab_size, seed=1)
    with ik.torch_oracle():
        want = reference(**batch)
        want.loss.backward()
    with ik.launches() as names:
        got = model(**batch)
        got.loss.backward()
    assert {RULE_FORWARD, RULE_BACKWARD, CONV_FORWARD, CONV_BACKWARD} <= set(names)
    assert_close(got.logits, want.logits, "logits", atol=2e-5)
    assert_close(got.loss, want.loss, "loss")
    _assert_model_grads(model, reference, atol=2e-5)  # the rule's blocked sums, as above


def test_packed_rows_without_cp_go_to_fla_with_cu_seqlens_and_equal_the_documents_alone():
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, packed_documents

    reference, model = build_tiny_causal_lm(seed=0), build_tiny_causal_lm(seed=0)
    install_fp32_gate(model)
    batch, documents = packed_documents(LENGTHS, reference.config.vocab_size, seed=1)
    with ik.torch_oracle():
        want_logits, want_loss = documents_alone(reference, documents)
        want_loss.backward()
    with ik.launches() as forward:
        got = model(**batch)
    with ik.launches() as backward:
        got.loss.backward()
    assert RULE_FORWARD in forward and CONV_FORWARD in forward and CONV_BACKWARD in backward
    # One varlen call of the rule and of the conv per GatedDeltaNet layer (2), not one per document:
    assert forward.count(RULE_FORWARD) == 2 and forward.count(CONV_FORWARD) == 2
    assert_close(got.logits, want_logits, "logits", atol=2e-5)
    assert_close(got.loss, want_loss, "loss")
    _assert_model_grads(model, reference, atol=2e-5)


def test_decoding_with_a_cache_goes_through_fla_recurrent_kernel_and_equals_the_oracle():
    """Generation (GRPO's): the prompt through FLA's chunked rule, each new token through FLA's
    fused recurrent kernel; the same tokens and per-step logits as the oracle's generation."""
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    reference, model = build_tiny_causal_lm(seed=0), build_tiny_causal_lm(seed=0)
    install_fp32_gate(model)
    prompt = torch.randint(1, reference.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    settings = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        with ik.torch_oracle():
            want = reference.generate(prompt, **settings)
        with ik.launches() as names:
            got = model.generate(prompt, **settings)
    assert RULE_FORWARD in names and names.count(RECURRENT) == 2 * 4  # 2 GatedDeltaNet layers × 4 cached steps
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert_close(a, b, f"logits of new token {step}", atol=2e-5)


def _cp_mesh(world: int, cp: int, tp: int = 1):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world // (cp * tp), cp, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def _parallel_worker(rank: int, world: int, cp: int, tp: int, exchanges: tuple[str, ...], packed: bool) -> None:
    """The tiny model under `PARALLELIZER.apply` at cp × tp (FSDP2 over the rest) equals the
    oracle: loss and every gradient, for each state exchange; FLA's kernels reached on every rank."""
    import torch.distributed as dist

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.context_parallel.gated_delta_net import ContextParallelGatedDeltaNet
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, packed_documents, random_batch

    ik.install()
    reference, model = build_tiny_causal_lm(seed=0), build_tiny_causal_lm(seed=0)
    vocab = reference.config.vocab_size
    with ik.torch_oracle():
        if packed:
            batch, documents = packed_documents([30, 3, 1, 14], vocab, seed=2)  # 48 tokens
            want_loss = documents_alone(reference, documents)[1]
        else:
            batch = random_batch(2, 32, vocab, seed=7)
            want_loss = reference(**batch).loss
        want_loss.backward()
    mesh = _cp_mesh(world, cp, tp)
    PARALLELIZER.apply(model, mesh)
    local = shard_batch(batch, mesh["cp"]) if cp > 1 else batch
    for exchange in exchanges:
        for layer in model.modules():
            if isinstance(layer, ContextParallelGatedDeltaNet):
                layer.state_exchange = exchange
        model.zero_grad(set_to_none=True)
        with ik.launches() as names:
            out = model(**local)
            out.loss.backward()
        assert {RULE_FORWARD, RULE_BACKWARD, CONV_FORWARD, CONV_BACKWARD} <= set(names), (rank, sorted(set(names)))
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # every rank holds the whole batch's mean (dp 1)
        assert_close(loss, want_loss.detach(), f"loss ({exchange})")
        # atol 2e-5: FLA's blocked sums, then the chunk summaries fold the recurrence in another order.
        _assert_model_grads(model, reference, atol=2e-5)
    dist.barrier()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world,cp,tp,exchanges,packed",
    [(2, 2, 1, ("allgather", "scan"), False), (2, 2, 1, ("auto",), True), (2, 1, 2, ("auto",), False),
     (4, 4, 1, ("allgather", "scan"), False)],
    ids=["cp2", "cp2-packed", "tp2", "cp4"],
)
def test_parallel_layers_through_fla_equal_the_oracle(world, cp, tp, exchanges, packed):
    """CP: the chunk summaries through FLA's rule, the conv halo through FLA's conv (cp 4: local
    chunks of 4 tokens, the halo spans a whole chunk); TP: each rank's value heads through the
    non-CP layer (Transformers' FLA function, FLA's conv); packed rows under CP."""
    from _dist import run_world

    run_world(_parallel_worker, world, cp, tp, exchanges, packed)
