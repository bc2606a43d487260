"""What the decoder keeps for backward: per layer kind (GatedDeltaNet, gated attention, MLP,
norms) with the kernels the step runs, or each layer's input under activation checkpointing."""

from __future__ import annotations

from .shapes import CHUNK, Device, ModelShape, Parallel, StepOptions


def _rms_norm(tokens: int, width: int) -> int:
    """Qwen3.5's RMSNorm (fp32 inside): the fp32 input and normalised output, the inverse
    norm per row, and (1 + weight) in fp32."""
    return tokens * (8 * width + 4) + 4 * width


def _norms_and_residuals(shape: ModelShape, tokens: int) -> int:
    """A decoder layer's two norms; the residual adds keep nothing."""
    return 2 * _rms_norm(tokens, shape.hidden)


def _mlp(shape: ModelShape, tokens: int, c: int, tp: int) -> int:
    """Input (the norm's output, c), gate and up outputs, SiLU output, their product (c)."""
    return tokens * shape.hidden * c + 4 * tokens * (shape.intermediate // tp) * c


def _moe_block(shape: ModelShape, tokens: int, c: int, parallel: Parallel) -> int:
    """A MoE layer's sparse block (Transformers' experts loop), this rank's share.

    Per token: the input (c), kept by the router, the shared expert and its gate; the router's
    fp32 probabilities [E] and its top-k ids (int64) and weights (fp32); the shared expert as an
    MLP of its width (split by tp) and its output (c); its gate's logit and sigmoid (c). Per
    (token, expert) pair this rank's experts run: the gathered input row, the expert's output
    before and after the routing weight (3 × hidden, c), gate_up's output (2 × I), the SiLU and
    the product (I each); the routing weight (c) and two int64 indices. Pairs per rank: every
    pair under dp (N·k); under tp each rank runs its experts over the shared tokens (N·k / tp,
    balanced routing), masking the others' routes (a bool per route); under ep the pairs its
    experts receive (N·k, balanced) and, for its own pairs, the returned rows the routing weights
    multiply (hidden, c) with their order (int64); under ep × tp both, for this tp rank's share of
    the pairs (N·k / tp), and the bool per route. Measured equal (fp32) and within 0.1 % (bf16)
    in one process (tests/test_memory_model.py); the parallel terms are derived, not measured."""
    h, e, k = shape.hidden, shape.experts, shape.experts_per_token
    pairs = tokens * k
    total = 2 * tokens * h * c + tokens * e * 4 + tokens * k * 12 + 2 * tokens * c
    total += 4 * tokens * (shape.shared_intermediate // parallel.tp) * c
    per_pair = (3 * h + 4 * shape.expert_intermediate) * c + 16 + c
    if parallel.tp > 1 and parallel.ep > 1:  # ep x tp: the pairs of this tp rank's experts, exchanged over ep
        return total + pairs // parallel.tp * (per_pair + h * c + 8) + pairs
    if parallel.tp > 1:
        return total + pairs // parallel.tp * per_pair + pairs
    if parallel.ep > 1:
        return total + pairs * per_pair + pairs * (h * c + 8)
    return total + pairs * per_pair


def _feed_forward(shape: ModelShape, tokens: int, c: int, parallel: Parallel) -> int:
    """A decoder layer's MLP: the dense one, or a MoE layer's sparse block."""
    return _moe_block(shape, tokens, c, parallel) if shape.experts else _mlp(shape, tokens, c, parallel.tp)


def torch_gated_delta_rule(
    rows: int, length: int, v_heads: int, k_dim: int, v_dim: int, *, strided: bool = False, conv_value: bool = False
) -> int:
    """Bytes torch's reference chunked rule keeps for one call on [rows, length] tokens
    (fp32 inside whatever the input dtype; query/key already repeated to v_heads).

    Per head and token: the l2-normalised query and key inputs with their inverse norms;
    six [*, k_dim] and three [*, v_dim] fp32 tensors over the padded length; five
    [chunk, chunk] matrices per chunk; four decay vectors; the state entering each chunk.
    `strided`: the inputs are strided views that the rule's fp32 cast leaves as they are
    (fp32 inputs: the cast aliases them; CP's summaries): when the length is a multiple
    of the chunk the no-op pad leaves them strided and the batched matmuls keep contiguous
    copies, four more [*, k_dim] tensors (one fewer with a single chunk), as measured
    (with several rows and repeated query/key heads, one [chunk, k_dim] tensor per row
    and head fewer: not counted, 0.6 % of a layer at 4 chunks, less at more).
    `conv_value`: query and key are views of the conv's fp32 output (fp32 inputs with as
    many key as value heads, so nothing repeats them): the l2 norm's saved input pins that
    whole output, its value part included, one [length, v_dim] tensor more.
    """
    padded = -(-length // CHUNK) * CHUNK
    chunks = padded // CHUNK
    per_row = (
        2 * v_heads * length * (k_dim + 1)
        + v_heads * padded * (6 * k_dim + 3 * v_dim + 5 * CHUNK + 4)
        + chunks * v_heads * (k_dim * v_dim + 1)
    )
    if strided and padded == length:
        per_row += (4 if chunks > 1 else -1) * v_heads * padded * k_dim
    if conv_value:
        per_row += v_heads * length * v_dim
    return 4 * rows * per_row + CHUNK * CHUNK  # + the bool causal mask, shared by the rows


def fla_gated_delta_rule(tokens: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, input_bytes: int) -> int:
    """Bytes FLA's `chunk_gated_delta_rule` keeps (its autograd function's saved tensors):
    the normalised q and k and v in the input dtype, the inverse norms and the cumulative
    decay in fp32, beta, and the solved [tokens, v_heads, 64] triangular blocks."""
    i = input_bytes
    return tokens * (2 * k_heads * k_dim * i + 2 * k_heads * 4 + v_heads * v_dim * i + v_heads * (4 + i) + v_heads * CHUNK * i)


def _gated_delta_net(shape: ModelShape, rows: int, tokens: int, c: int, parallel: Parallel, fla: bool) -> int:
    """One GatedDeltaNet mixer (no norms around it), this rank's heads."""
    tp, cp = parallel.tp, parallel.cp
    hv, hk, dk, dv = shape.v_heads // tp, shape.k_heads // tp, shape.k_dim, shape.v_dim
    conv_dim = shape.conv_dim // tp
    value = hv * dv
    total = tokens * shape.hidden * c  # the projections' input
    total += 2 * tokens * hv * 4 + 2 * hv * 4  # the fp32 decay gate: softplus input and output
    total += tokens * hv * c  # beta (sigmoid output)
    # the gated norm on [tokens * heads, v_dim]: fp32 input, gate and SiLU output, the
    # normalised and the gated products in c, inverse norms
    total += tokens * value * (3 * 4 + 2 * c) + tokens * hv * 4
    total += tokens * value * c  # out_proj's input
    local = tokens // rows
    if not fla:
        halo = shape.conv_kernel - 1
        if cp == 1:  # Transformers' conv: its input, and the SiLU's input over seq + K − 1
            total += rows * conv_dim * (2 * local + halo) * c
            fp32 = c == 4  # the rule's fp32 cast then aliases its inputs instead of copying them
            total += torch_gated_delta_rule(rows, local, hv, dk, dv, strided=fp32, conv_value=fp32 and hk == hv)
        else:  # each of the two chunks convolved behind its halo (input; SiLU input, K − 1 wider)
            total += rows * conv_dim * (2 * local + 6 * halo) * c
            total += _cp_gated_delta_rule_cpu(rows, local // 2, hv, dk, dv)
    else:
        total += tokens * conv_dim * c  # causal-conv1d keeps its input (SiLU fused)
        if cp == 1:
            total += fla_gated_delta_rule(tokens, hk, hv, dk, dv, c)
        else:  # chunk summaries: fp32 inputs, values [v | 0], an initial state per chunk, o0 and w
            total += 2 * fla_gated_delta_rule(tokens // 2, hk, hv, dk, dv + dk, 4)
            total += tokens * hv * (dv + dk) * 4 + 2 * rows * hv * dk * (dv + 2 * dk) * 4
    return total


def _cp_gated_delta_rule_cpu(rows: int, half: int, v_heads: int, k_dim: int, v_dim: int) -> int:
    """`cp_gated_delta_rule` on CPU for one rank's two chunks of `half` tokens each: two
    summaries by torch's rule on values [v | 0] from the state [0 | I], and reading the
    incoming state (o0 and w, kept by the einsum, and the state), plus the state exchange's
    fold (transitions and states, independent of the sequence)."""
    per_chunk = torch_gated_delta_rule(rows, half, v_heads, k_dim, v_dim + k_dim, strided=True)
    per_chunk += rows * half * v_heads * (v_dim + k_dim) * 4 + rows * v_heads * k_dim * v_dim * 4
    exchange = rows * v_heads * k_dim * (3 * k_dim + 2 * v_dim) * 4
    return 2 * per_chunk + exchange


def _attention(shape: ModelShape, rows: int, tokens: int, c: int, parallel: Parallel, device: Device) -> int:
    """One gated full-attention mixer (no norms around it), this rank's heads."""
    tp, cp = parallel.tp, parallel.cp
    q, kv = shape.heads // tp * shape.head_dim, shape.kv_heads // tp * shape.head_dim
    heads = shape.heads // tp
    total = tokens * shape.hidden * c  # the projections' input
    # q_norm / k_norm: fp32 input (in fp32: q_proj's whole output, query and gate), normalised
    # output, inverse norms
    total += tokens * q * (8 + (4 if c == 4 else 0)) + tokens * heads * 4 + 4 * shape.head_dim
    total += tokens * kv * 8 + tokens * (shape.kv_heads // tp) * 4 + 4 * shape.head_dim
    total += 3 * tokens * q * c  # the output, the gate's sigmoid, o_proj's input
    total += tokens * q * c  # the rotated query
    if cp == 1:
        total += 2 * tokens * kv * c  # the rotated key, the value
        total += tokens * q * c + tokens * heads * 4  # SDPA's output and log-sum-exp
    else:  # the all-gathered keys and values of the whole sequence
        total += 2 * tokens * cp * kv * c
        if device != "cpu":  # on CPU the chunks' attention is recomputed in backward
            total += tokens * q * c + tokens * heads * 4
    return total


def layer_activations(shape: ModelShape, kind: str, parallel: Parallel, options: StepOptions) -> int:
    """Bytes one decoder layer of `kind` keeps for backward on a rank, without checkpointing."""
    rows = options.batch_size
    tokens = rows * options.seq_len // parallel.cp
    c = options.compute_bytes
    if kind == "linear_attention":
        mixer = _gated_delta_net(shape, rows, tokens, c, parallel, options.fla and options.device == "cuda")
    else:
        mixer = _attention(shape, rows, tokens, c, parallel, options.device)
    return mixer + _feed_forward(shape, tokens, c, parallel) + _norms_and_residuals(shape, tokens)


# With activation offload, the layer inputs on the device at once: the one being copied out (its
# copy queued behind the layer that made it) and the one copied back for the recompute.
OFFLOAD_IN_FLIGHT = 2


def pinned_bytes(nbytes: int) -> int:
    """What torch's caching host allocator takes for a pinned buffer of `nbytes`: each block is
    rounded up to a power of two (a 1.25 GiB layer input takes 2 GiB of pinned memory)."""
    return 1 << max(0, nbytes - 1).bit_length()


def host_activations(shape: ModelShape, parallel: Parallel, options: StepOptions) -> int:
    """Bytes of host memory a rank holds with activation offload: every checkpointed layer's
    input hidden states (0 without offload), on a GPU in pinned buffers, each rounded up to a
    power of two (`pinned_bytes`); on the host nothing is copied."""
    if not options.activation_offload:
        return 0
    per_layer = options.batch_size * options.seq_len // parallel.cp * shape.hidden * options.compute_bytes
    return shape.layers * (per_layer if options.device == "cpu" else pinned_bytes(per_layer))


def activations(shape: ModelShape, parallel: Parallel, options: StepOptions) -> int:
    """Bytes the decoder keeps for backward on a rank (the loss path apart)."""
    tokens = options.batch_size * options.seq_len // parallel.cp
    c = options.compute_bytes
    outside = 8 * tokens + _rms_norm(tokens, shape.hidden)  # token ids, the final norm
    if shape.full_layers:
        outside += 2 * tokens * shape.rotary_dim * c  # cos and sin, shared by the attention layers
    if shape.router_loss:  # every layer's router logits, recorded for the load-balancing loss
        outside += shape.layers * tokens * shape.experts * c
    if options.activation_checkpointing:  # what each checkpoint holds: the layer's input, the positions
        held = OFFLOAD_IN_FLIGHT if options.activation_offload else shape.layers
        return outside + held * tokens * shape.hidden * c + 8 * tokens
    return outside + sum(
        count * layer_activations(shape, kind, parallel, options)
        for kind, count in (("linear_attention", shape.linear_layers), ("full_attention", shape.full_layers))
    )
