"""How many bytes a training step of a dense Qwen3.5 holds per rank: the model behind `plan`.

Pure arithmetic over the model's shape (`ModelShape`), the parallel sizes (`Parallel`) and
the step's options (`StepOptions`); nothing is built or run. Per rank:

- parameters: the FSDP2 shard of every parameter (tp-sliced ones hold 1/tp of the whole),
  stored in fp32 under a bf16/fp16 policy (Accelerate upcasts trainable parameters: that
  fp32 shard *is* the master copy);
- gradients: the same shard, in the storage dtype;
- optimizer state: AdamW two moments, SGD one momentum buffer, none nothing (storage dtype);
- activations: what the decoder keeps for backward, per layer kind (GatedDeltaNet, gated
  attention, MLP, norms and residuals), or only each layer's input under activation
  checkpointing; local tokens are batch × seq_len / cp, heads and the MLP width / tp;
- loss: what the lm_head and the cross entropy keep (tiled "recompute": the hidden states
  and one fp32 per token; "hold": the gradients computed in forward, of the hidden states
  [tokens, hidden] and of the lm_head weight [vocab / tp, hidden], in the compute dtype;
  Transformers' loss: an fp32 [tokens, vocab] log-softmax);
- transient: what the step's peak adds to the above: the FSDP2 units gathered at the
  prefetch depths (with one unit's unsharded gradient in backward), and the largest of the
  loss's working bytes (`loss_transient`: one tile and the fp32 gradient accumulators, or
  Transformers' two fp32 [tokens, vocab] gradients) with the tail's gradient, and, less
  the loss's bytes (freed by then), CP's gathered K/V (and its gradient) in an attention
  layer and a layer recomputed under checkpointing;
- a VLM's vision tower (`VisionTower`, `vision_estimate`, added by `step_estimate`): its
  parameters as FSDP2 holds them (trainable or frozen, per `frozen_multimodal_sharding`),
  gradients and optimizer state when trainable, and what its blocks keep for a given number
  of image tokens (`tests/test_vlm_plan.py` checks them against the sharded tiny VLM).

The activation and loss formulas were written from what saved-tensor hooks record on the
unmodified Transformers model and on this package's CP/TP layers (`tests/test_memory_model.py`
checks them within ±10 % on CPU); the loss path's peak (`loss_saved + loss_transient`, each
mode, fp32 and bf16) from every tensor's lifetime (torch's MemTracker), within ±4 % on CPU.
The GatedDeltaNet core and the causal conv depend on the kernels: without FLA (and always
on CPU) torch's reference chunked rule (fp32 inside, per-chunk [64, 64] matrices kept) and
Transformers' torch conv; with FLA on CUDA, FLA's `chunk_gated_delta_rule` and causal-conv1d,
from what their autograd functions save (not measured here: no GPU).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

Device = Literal["cpu", "cuda"]
OPTIMIZERS = ("adamw", "sgd", "none")
# Optimizer state per trainable parameter, in units of the parameter's storage dtype.
_OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}
CHUNK = 64  # the chunk length of the chunked gated delta rule (Transformers' and FLA's)
DEFAULT_LOSS_TILE_BYTES = 2**28  # fp32 logits per loss tile: at most 256 MiB (tiled_head.TILE_BYTES)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a dense Qwen3.5 text model that memory depends on."""

    hidden: int
    intermediate: int
    vocab: int
    linear_layers: int  # GatedDeltaNet layers
    full_layers: int  # gated full-attention layers
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    k_heads: int  # GatedDeltaNet key heads
    v_heads: int  # GatedDeltaNet value heads
    k_dim: int
    v_dim: int
    conv_kernel: int
    tied_embeddings: bool = False
    attention_bias: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a Transformers Qwen3.5 config (text or multimodal: its text config is used)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        rope = getattr(text, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
        kinds = list(text.layer_types)
        return cls(
            hidden=text.hidden_size,
            intermediate=text.intermediate_size,
            vocab=text.vocab_size,
            linear_layers=kinds.count("linear_attention"),
            full_layers=kinds.count("full_attention"),
            heads=text.num_attention_heads,
            kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * factor),
            k_heads=text.linear_num_key_heads,
            v_heads=text.linear_num_value_heads,
            k_dim=text.linear_key_head_dim,
            v_dim=text.linear_value_head_dim,
            conv_kernel=text.linear_conv_kernel_dim,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))),
            attention_bias=bool(getattr(text, "attention_bias", False)),
        )

    @property
    def layers(self) -> int:
        return self.linear_layers + self.full_layers

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def layer_parameters(self, kind: str) -> tuple[int, int]:
        """(parameters split by tp, parameters replicated over tp) of one decoder layer of
        `kind` ("linear_attention" or "full_attention"), MLP and both norms included."""
        h = self.hidden
        split = 3 * h * self.intermediate
        whole = 2 * h  # input and post-attention norms
        if kind == "linear_attention":
            value = self.v_heads * self.v_dim
            split += self.conv_dim * h + value * h + 2 * self.v_heads * h  # in_proj_qkv, z, b, a
            split += self.conv_dim * self.conv_kernel + 2 * self.v_heads + value * h  # conv, gate holder, out_proj
            whole += self.v_dim  # the gated norm
        else:
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            split += (2 * q + 2 * kv) * h + q * h  # q_proj (query and gate), k/v_proj, o_proj
            if self.attention_bias:
                split += 2 * q + 2 * kv + h
            whole += 2 * self.head_dim  # q_norm, k_norm
        return split, whole

    def parameters(self) -> int:
        """All parameters of the text model."""
        total = self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden
        for kind, count in (("linear_attention", self.linear_layers), ("full_attention", self.full_layers)):
            total += count * sum(self.layer_parameters(kind))
        return total


@dataclass(frozen=True)
class Parallel:
    """Mesh sizes (world = their product) and whether the lm_head is split by vocab over tp."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    vocab_parallel_lm_head: bool = False

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp_shards(self) -> int:
        return self.dp_shard * self.cp


@dataclass(frozen=True)
class StepOptions:
    """One training step's choices. `seq_len`: tokens per sequence (whole, before CP);
    `compute_bytes`: the compute dtype's size (2 under bf16/fp16, else the storage's);
    `param_bytes`: the storage dtype's size (4 under a bf16/fp16 policy: fp32 masters);
    `device`: where the step runs; `fla`: on "cuda", whether FLA and causal-conv1d are
    installed (the GatedDeltaNet kernels; without them Transformers' torch kernels run);
    `tiled_loss`: "hold", "recompute" or "off" (Transformers' loss), as the setting of that
    name (True is "hold", False "off")."""

    seq_len: int
    batch_size: int = 1
    compute_bytes: int = 2
    param_bytes: int = 4
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    tiled_loss: bool | str = "hold"
    loss_tile_bytes: int = DEFAULT_LOSS_TILE_BYTES
    forward_prefetch_depth: int = 1
    backward_prefetch_depth: int = 2
    device: Device = "cuda"
    fla: bool = True

    def __post_init__(self) -> None:
        from .parallel.tiled_head import LOSS_MODES

        if isinstance(self.tiled_loss, bool):
            object.__setattr__(self, "tiled_loss", "hold" if self.tiled_loss else "off")
        if self.tiled_loss not in ("off", *LOSS_MODES):
            raise ValueError(f"tiled_loss {self.tiled_loss!r} is not one of off, {', '.join(LOSS_MODES)}; pass one of them")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}; pass one of them")
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError(f"seq_len {self.seq_len}, batch_size {self.batch_size}: both must be at least 1")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank (the most loaded rank); `total` is their sum."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    loss: int
    transient: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.loss + self.transient

    def as_dict(self) -> dict[str, int]:
        """The keys of `plan --json`'s `memory_per_rank` (integers, bytes)."""
        return {**asdict(self), "total": self.total}


def loss_tile_tokens(vocab_local: int, tile_bytes: int = DEFAULT_LOSS_TILE_BYTES) -> int:
    """Tokens per loss tile, as the tiled loss takes them (`parallel.tiled_head.token_tile_size`)."""
    from .parallel.tiled_head import token_tile_size

    return token_tile_size(vocab_local, tile_bytes)


# Activations: what one decoder layer keeps for backward (T tokens on this rank, batch rows B).

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


def torch_gated_delta_rule(rows: int, length: int, v_heads: int, k_dim: int, v_dim: int, *, strided: bool = False) -> int:
    """Bytes torch's reference chunked rule keeps for one call on [rows, length] tokens
    (fp32 inside whatever the input dtype; query/key already repeated to v_heads).

    Per head and token: the l2-normalised query and key inputs with their inverse norms;
    six [*, k_dim] and three [*, v_dim] fp32 tensors over the padded length; five
    [chunk, chunk] matrices per chunk; four decay vectors; the state entering each chunk.
    When the length is a multiple of the chunk the kernel's no-op pad leaves strided views
    and its batched matmuls keep contiguous copies: four more [*, k_dim] tensors (one
    fewer with a single chunk), as measured.
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
            total += torch_gated_delta_rule(rows, local, hv, dk, dv)
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
    return mixer + _mlp(shape, tokens, c, parallel.tp) + _norms_and_residuals(shape, tokens)


def activations(shape: ModelShape, parallel: Parallel, options: StepOptions) -> int:
    """Bytes the decoder keeps for backward on a rank (the loss path apart)."""
    tokens = options.batch_size * options.seq_len // parallel.cp
    c = options.compute_bytes
    outside = 8 * tokens + _rms_norm(tokens, shape.hidden)  # token ids, the final norm
    if shape.full_layers:
        outside += 2 * tokens * shape.rotary_dim * c  # cos and sin, shared by the attention layers
    if options.activation_checkpointing:  # what each checkpoint holds: the layer's input, the positions
        return outside + shape.layers * tokens * shape.hidden * c + 8 * tokens
    return outside + sum(
        count * layer_activations(shape, kind, parallel, options)
        for kind, count in (("linear_attention", shape.linear_layers), ("full_attention", shape.full_layers))
    )


def _vocab_local(shape: ModelShape, parallel: Parallel) -> int:
    return shape.vocab // parallel.tp if parallel.vocab_parallel_lm_head else shape.vocab


def loss_saved(shape: ModelShape, parallel: Parallel, options: StepOptions) -> int:
    """Bytes the lm_head and the cross entropy keep for backward on a rank.

    Tiled (`parallel.tiled_head.linear_cross_entropy_sum`), every token labelled:
    "recompute": the labelled hidden states in the compute dtype, the int64 targets, one fp32
    log-sum-exp per token and the bool mask of labelled tokens; "hold" (gradients computed in
    forward): the gradients of the hidden states and of this rank's lm_head rows, in the
    compute dtype, and the mask. Transformers' loss: the lm_head's input, the fp32
    log-softmax [tokens, vocab] and the targets; vocab-parallel TP: the fp32 exponentials of
    this rank's vocab slice.
    """
    tokens = options.batch_size * options.seq_len // parallel.cp
    hidden = tokens * shape.hidden * options.compute_bytes
    if options.tiled_loss == "recompute":
        return hidden + tokens * (8 + 4 + 1)
    if options.tiled_loss == "hold":
        return hidden + _vocab_local(shape, parallel) * shape.hidden * options.compute_bytes + tokens
    return hidden + tokens * _vocab_local(shape, parallel) * 4 + (tokens + options.batch_size) * 8


def loss_transient(shape: ModelShape, parallel: Parallel, options: StepOptions) -> int:
    """Bytes the lm_head and the cross entropy use on a rank beyond `loss_saved` at their
    peak, the gradients they hand back included (FSDP2's copies of the tail's gradient not).

    Tiled, at the end of the last tile (forward with "hold", backward with "recompute"): the
    fp32 accumulators of the gradients of the hidden states and of this rank's lm_head rows,
    one tile's fp32 logits, and under a 16-bit compute dtype the tile's copy in it (the GEMMs'
    operand) and the gradients in it as handed back ("hold" holds those: `loss_saved`; in
    fp32 its accumulators are what it holds). Transformers' loss, in backward beside its
    saved fp32 log-softmax: two fp32 `[tokens, vocab]` gradients (the NLL's and the
    log-softmax's), more than forward's logits with their fp32 copy.
    """
    tokens = options.batch_size * options.seq_len // parallel.cp
    vocab = _vocab_local(shape, parallel)
    c = options.compute_bytes
    if options.tiled_loss == "off":
        return tokens * vocab * 8
    copies = 0 if c == 4 else c
    tile = min(tokens, loss_tile_tokens(vocab, options.loss_tile_bytes))
    gradients = (vocab + tokens) * shape.hidden
    if options.tiled_loss == "hold":
        return tile * vocab * (4 + copies) + gradients * (4 if copies else 0)
    return tile * vocab * (4 + copies) + gradients * (4 + copies)


def _sharded(count: int, parallel: Parallel) -> int:
    return -(-count // parallel.fsdp_shards)


def _parameter_counts(shape: ModelShape, parallel: Parallel) -> tuple[int, int, int]:
    """(parameters per rank, the largest decoder-layer unit gathered on a rank, the
    embedding/lm_head tail gathered on a rank), in parameters."""
    tp = parallel.tp
    per_rank = 0
    largest = 0
    for kind, count in (("linear_attention", shape.linear_layers), ("full_attention", shape.full_layers)):
        if count:
            split, whole = shape.layer_parameters(kind)
            gathered = split // tp + whole
            per_rank += count * _sharded(gathered, parallel)
            largest = max(largest, gathered)
    embedding = shape.vocab * shape.hidden
    head = embedding // tp if parallel.vocab_parallel_lm_head else embedding
    per_rank += _sharded(embedding, parallel) + _sharded(shape.hidden, parallel)
    if not shape.tied_embeddings:
        per_rank += _sharded(head, parallel)
    return per_rank, largest, (head if not shape.tied_embeddings else embedding) + shape.hidden


def estimate(shape: ModelShape, parallel: Parallel, options: StepOptions) -> MemoryEstimate:
    """The memory per rank of one training step (see the module docstring)."""
    if options.seq_len % (2 * parallel.cp if parallel.cp > 1 else 1):
        raise ValueError(f"seq_len {options.seq_len} is not divisible by 2*cp = {2 * parallel.cp}; pass a multiple of it")
    params, largest_layer, tail = _parameter_counts(shape, parallel)
    p, c = options.param_bytes, options.compute_bytes
    # FSDP2 in flight: the running unit plus the prefetched ones (forward, or backward with the
    # running unit's unsharded gradient, in c and copied to fp32 for the reduce-scatter), and
    # the tail kept gathered; the tail's own gradient arrives with the loss's backward.
    gathered = max(
        (1 + options.forward_prefetch_depth) * largest_layer * c,
        (1 + options.backward_prefetch_depth) * largest_layer * c + largest_layer * (c + 4),
    ) + tail * c
    # The tail's gradient: Transformers' loss makes it in c; the tiled loss's working bytes
    # include it (or hold it); FSDP2 then copies it to fp32 for the reduce-scatter.
    tail_gradient = tail * (4 if options.tiled_loss != "off" else c + 4)
    # The loss's bytes live from the end of forward to the loss's backward; the other peaks
    # (a layer recomputed in backward, CP's K/V) come while they do not, so those peaks
    # count only what exceeds them.
    loss = loss_saved(shape, parallel, options)
    others = []
    if options.activation_checkpointing:
        others += [layer_activations(shape, kind, parallel, options) for kind, n in
                   (("linear_attention", shape.linear_layers), ("full_attention", shape.full_layers)) if n]
    if parallel.cp > 1 and shape.full_layers:
        tokens = options.batch_size * options.seq_len
        others.append(2 * 2 * tokens * shape.kv_heads // parallel.tp * shape.head_dim * c)  # K/V and their gradient
    at_loss = loss_transient(shape, parallel, options) + tail_gradient
    return MemoryEstimate(
        parameters=params * p,
        gradients=params * p,
        optimizer_states=params * p * _OPTIMIZER_STATES[options.optimizer],
        activations=activations(shape, parallel, options),
        loss=loss,
        transient=gathered + max([at_loss] + [peak - loss for peak in others]),
    )


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'141GB', '139.8 GiB', '80000MB', '1024' (bytes) -> bytes; ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"{text!r} is not a memory size; pass a positive number with a unit, e.g. 141GB, 139.8GiB or 80000MB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def suggest_cp(
    shape: ModelShape, parallel: Parallel, options: StepOptions, gpu_bytes: int, vision: VisionTower | None = None
) -> int | None:
    """The smallest cp (checkpointing on) whose plan fits `gpu_bytes` with the same world
    size and tp (cp taken from dp_shard), or None. cp must divide the world left by tp and
    dp_replicate, and 2·cp must divide seq_len. `vision`: a VLM's tower (`step_estimate`)."""
    budget = parallel.world // (parallel.tp * parallel.dp_replicate)
    checkpointed = _replace(options, activation_checkpointing=True)
    for cp in range(1, budget + 1):
        if budget % cp or options.seq_len % (2 * cp if cp > 1 else 1):
            continue
        candidate = Parallel(parallel.dp_replicate, budget // cp, cp, parallel.tp, parallel.vocab_parallel_lm_head)
        if step_estimate(shape, candidate, checkpointed, vision).total <= gpu_bytes:
            return cp
    return None


def longest_seq_len(
    shape: ModelShape, parallel: Parallel, options: StepOptions, gpu_bytes: int, step: int = 1024,
    vision: VisionTower | None = None,
) -> int:
    """The longest multiple of `step` (and of 2·cp) whose plan fits `gpu_bytes`; 0 if none.
    `vision`: a VLM's tower, its image tokens unchanged (`step_estimate`)."""
    step = math.lcm(step, 2 * parallel.cp)
    if step_estimate(shape, parallel, _replace(options, seq_len=step), vision).total > gpu_bytes:
        return 0
    low, high = 1, 2
    while step_estimate(shape, parallel, _replace(options, seq_len=high * step), vision).total <= gpu_bytes:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if step_estimate(shape, parallel, _replace(options, seq_len=middle * step), vision).total <= gpu_bytes:
            low = middle
        else:
            high = middle
    return low * step


def _replace(options: StepOptions, **changes: Any) -> StepOptions:
    return StepOptions(**{**asdict(options), **changes})


def _gib(n: int) -> str:
    """Bytes in GiB (MiB below 1 GiB: tiny models)."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.2f} MiB"


def memory_report(
    shape: ModelShape, parallel: Parallel, options: StepOptions, gpu_bytes: int | None = None, suggest: bool = False,
    vision: VisionTower | None = None,
) -> dict[str, Any]:
    """What `plan --json` carries: `memory_per_rank` (bytes), the step it assumes, and with
    `gpu_bytes` whether it fits (`fits`, `margin_bytes` = gpu_bytes − total) and, with
    `suggest`, `suggested_cp` (`suggest_cp`; None if no cp fits). `vision`: a VLM's tower,
    included in `memory_per_rank` (`step_estimate`)."""
    per_rank = step_estimate(shape, parallel, options, vision).as_dict()
    report: dict[str, Any] = {"memory_per_rank": per_rank, "memory_assumptions": asdict(options)}
    if gpu_bytes is not None:
        report.update(gpu_memory_bytes=gpu_bytes, fits=per_rank["total"] <= gpu_bytes, margin_bytes=gpu_bytes - per_rank["total"])
        if suggest:
            report["suggested_cp"] = suggest_cp(shape, parallel, options, gpu_bytes, vision)
    return report


def describe(report: dict[str, Any], gpus: int) -> list[str]:
    """`memory_report` as the lines `plan` prints."""
    m, o = report["memory_per_rank"], report["memory_assumptions"]
    loss = f"tiled loss ({o['tiled_loss']})" if o["tiled_loss"] != "off" else "Transformers' loss"
    kernels = "FLA/causal-conv1d" if o["fla"] and o["device"] == "cuda" else "torch"
    lines = [
        f"memory per rank (seq_len {o['seq_len']}, batch {o['batch_size']}, {o['optimizer']}, "
        f"checkpointing {'on' if o['activation_checkpointing'] else 'off'}, {loss}, {kernels} GatedDeltaNet kernels):",
        "  " + ", ".join(f"{key} {_gib(value)}" for key, value in m.items() if key != "total"),
        f"  total {_gib(m['total'])}",
    ]
    if "fits" in report:
        margin, budget = report["margin_bytes"], _gib(report["gpu_memory_bytes"])
        lines.append(f"  fits in {budget}: {_gib(margin)} to spare" if report["fits"]
                     else f"  does not fit in {budget}: {_gib(-margin)} over")
    if "suggested_cp" in report:
        cp = report["suggested_cp"]
        lines.append(
            f"  suggested: cp {cp} with activation checkpointing (the smallest that fits; dp_shard takes the rest of the {gpus} GPUs)" if cp
            else f"  suggested: none: no cp on {gpus} GPUs fits, even with activation checkpointing"
        )
    return lines


# The vision tower of a Qwen3.5 VLM (`Qwen3_5ForConditionalGeneration`).

VISION_FROZEN_SHARDINGS = ("root", "replicate", "shard")  # QWEN35_ACCEL_FROZEN_MULTIMODAL_SHARDING


@dataclass(frozen=True)
class VisionShape:
    """The sizes of a Qwen3.5 vision tower (`Qwen3_5VisionModel`) that memory depends on."""

    hidden: int
    intermediate: int
    depth: int
    heads: int
    in_channels: int
    patch: int
    temporal_patch: int
    merge: int  # spatial_merge_size: merge x merge patches make one token of the text sequence
    out_hidden: int
    position_embeddings: int

    @classmethod
    def from_config(cls, config: Any) -> VisionShape | None:
        """From a Transformers Qwen3.5 config; None for a text config (no `vision_config`)."""
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        return cls(
            hidden=vision.hidden_size,
            intermediate=vision.intermediate_size,
            depth=vision.depth,
            heads=vision.num_heads,
            in_channels=vision.in_channels,
            patch=int(vision.patch_size),
            temporal_patch=int(vision.temporal_patch_size),
            merge=vision.spatial_merge_size,
            out_hidden=vision.out_hidden_size,
            position_embeddings=vision.num_position_embeddings,
        )

    @property
    def patch_dim(self) -> int:
        """Values per patch (a row of `pixel_values`)."""
        return self.in_channels * self.temporal_patch * self.patch**2

    def block_parameters(self) -> list[tuple[int, ...]]:
        """Shapes of one vision block's parameters: two LayerNorms, qkv and proj, the MLP."""
        h, i = self.hidden, self.intermediate
        return [(h,)] * 4 + [(3 * h, h), (3 * h,), (h, h), (h,), (i, h), (i,), (h, i), (h,)]

    def outer_parameters(self) -> list[tuple[int, ...]]:
        """Shapes of the parameters outside the blocks: patch embedding (a Conv3d), position
        embedding, merger (LayerNorm, two Linears on merge² patches)."""
        h, merged = self.hidden, self.hidden * self.merge**2
        return [
            (h, self.in_channels, self.temporal_patch, self.patch, self.patch), (h,), (self.position_embeddings, h),
            (h,), (h,), (merged, merged), (merged,), (self.out_hidden, merged), (self.out_hidden,),
        ]

    def parameters(self) -> int:
        """All parameters of the tower."""
        return self.depth * _elements(self.block_parameters()) + _elements(self.outer_parameters())


@dataclass(frozen=True)
class VisionTower:
    """A VLM's vision tower as a training step uses it.

    `trainable`: whether it trains (else frozen: no gradients, no optimizer state, no
    activations); `frozen_sharding`: a frozen tower's `frozen_multimodal_sharding`;
    `image_tokens`: image and video tokens in a rank's micro-batch (whole sequences, before
    CP; the tower encodes merge² patches per token), 0 for a text-only step; `storage_bytes`:
    a frozen tower's storage dtype size (Accelerate upcasts only trainable parameters to fp32
    under a bf16/fp16 policy; a trainable tower uses `StepOptions.param_bytes`).
    """

    shape: VisionShape
    trainable: bool = True
    frozen_sharding: str = "root"
    image_tokens: int = 0
    storage_bytes: int = 4

    def __post_init__(self) -> None:
        if self.frozen_sharding not in VISION_FROZEN_SHARDINGS:
            raise ValueError(
                f"frozen_sharding {self.frozen_sharding!r} is not one of {', '.join(VISION_FROZEN_SHARDINGS)}; pass one of them"
            )
        if self.image_tokens < 0:
            raise ValueError(f"image_tokens {self.image_tokens} is negative; pass 0 (a text-only step) or more")

    @property
    def layout(self) -> str:
        """How FSDP2 holds the tower (`PARALLELIZER.apply`): "units" (one unit per block, the
        rest in the root unit: a trainable tower, or frozen under "shard"), "root" (every
        parameter in the root unit) or "replicate" (not sharded: whole on every rank)."""
        return "units" if self.trainable or self.frozen_sharding == "shard" else self.frozen_sharding

    def patches_per_rank(self, parallel: Parallel) -> int:
        """Patches the tower encodes on a rank per micro-step: the image tokens' merge² patches
        each, split over the cp ranks; a text-only step of a tower with units runs the
        placeholder image (one token) instead."""
        tokens = self.image_tokens or (1 if self.layout == "units" else 0)
        return -(-tokens * self.shape.merge**2 // parallel.cp)


def _elements(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def _shard_elements(shapes: list[tuple[int, ...]], shards: int) -> int:
    """Elements on the most loaded rank (rank 0) when FSDP2 splits each tensor's dim 0 in `shards`."""
    return sum(-(-s[0] // shards) * math.prod(s[1:]) for s in shapes)


def _vision_block(shape: VisionShape, compute_bytes: int, device: Device, cast_block_inputs: bool) -> int:
    """Bytes one vision block keeps for backward per patch, not checkpointed (`vision_activations`)."""
    h, i, c = shape.hidden, shape.intermediate, compute_bytes
    stats = 4 if device == "cuda" else c
    rotary = 2 * (h // shape.heads) * 4  # cos and sin, fp32
    return 11 * h * c + 2 * i * c + 4 * stats + 4 * shape.heads + (rotary if cast_block_inputs else 0)


def vision_activations(
    shape: VisionShape, patches: int, compute_bytes: int, device: Device = "cuda", *, cast_block_inputs: bool = False,
    checkpointed: bool = False,
) -> int:
    """Bytes a trainable tower keeps for backward for `patches` patches (sdpa attention per image).

    Per block: the LayerNorms' inputs and mean/rstd (fp32 on CUDA, the input dtype on CPU),
    qkv's input and output (the value is a view of it), the rotated query and key, the
    attention output and fp32 log-sum-exp, proj's input, the MLP's input, fc1's output and
    the activation's output. Once: the patches cast to the compute dtype (the Conv3d's
    input), the position-embedding indices and fp32 weights (4 per patch), the fp32 rotary
    cos and sin, and the merger (LayerNorm input and stats, both Linears' inputs, GELU's).
    `cast_block_inputs`: the blocks are FSDP2 units under a bf16/fp16 policy, which casts
    their inputs, cos and sin included; each block's rotary then keeps fp32 copies of its own.
    `checkpointed` (activation checkpointing, a trainable tower): each block keeps only what
    it was called with, its input and, under `cast_block_inputs`, its cast cos and sin (the
    shared fp32 ones otherwise, counted once); one block's recomputation in backward is a
    transient (`vision_estimate`)."""
    h, c = shape.hidden, compute_bytes
    stats = 4 if device == "cuda" else c
    rotary = 2 * (h // shape.heads) * 4  # cos and sin, fp32
    if checkpointed:
        block = h * c + (2 * (h // shape.heads) * c if cast_block_inputs else 0)
    else:
        block = _vision_block(shape, c, device, cast_block_inputs)
    outside = shape.patch_dim * c + 8 * 4 + 4 * 4 + (0 if cast_block_inputs else rotary) + 4 * h * c + 2 * stats
    return patches * (shape.depth * block + outside)


def vision_estimate(vision: VisionTower, parallel: Parallel, options: StepOptions) -> MemoryEstimate:
    """The vision tower's share of a training step's memory per rank (the most loaded rank).

    Parameters: FSDP2 shards over dp_shard × cp (whole under "replicate"; replicated over
    tp: the tower has no TP plan), fp32 masters when trainable under a bf16/fp16 policy, the
    storage dtype when frozen. Gradients and optimizer state: the trainable shard's.
    Activations: `vision_activations`, checkpointed per block when `options` has activation
    checkpointing and the tower trains (`PARALLELIZER.apply` leaves a frozen tower alone:
    it keeps nothing). Transient: the root unit's vision parameters, gathered in the
    compute dtype for the whole step ("root": the whole tower), plus, while the tower runs,
    a block unit and the next one FSDP2 prefetches (backward: with the running unit's
    unsharded gradient, copied to fp32 for the reduce-scatter) and, checkpointed, one
    block's recomputed activations; the tower runs before the decoder in forward and after
    it in backward, so counting it beside the decoder's peak overstates the step's peak by
    at most that much.
    """
    shape, shards, c = vision.shape, parallel.fsdp_shards, options.compute_bytes
    blocks, outer = shape.block_parameters() * shape.depth, shape.outer_parameters()
    p = options.param_bytes if vision.trainable else vision.storage_bytes
    block = _elements(shape.block_parameters())
    if vision.layout == "replicate":
        held, gathered = _elements(blocks) + _elements(outer), 0
    elif vision.layout == "root":
        held, gathered = _shard_elements(blocks + outer, shards), shape.parameters() * c
    else:
        held = _shard_elements(blocks, shards) + _shard_elements(outer, shards)
        gathered = _elements(outer) * c + 2 * block * c + (block * (c + 4) if vision.trainable else 0)
    trained = held if vision.trainable else 0
    patches = vision.patches_per_rank(parallel) if vision.trainable else 0
    cast = vision.layout == "units" and c < options.param_bytes
    checkpointed = options.activation_checkpointing and vision.trainable
    recomputed = patches * _vision_block(shape, c, options.device, cast) if checkpointed else 0
    return MemoryEstimate(
        parameters=held * p,
        gradients=trained * p,
        optimizer_states=trained * p * _OPTIMIZER_STATES[options.optimizer],
        activations=vision_activations(shape, patches, c, options.device, cast_block_inputs=cast, checkpointed=checkpointed),
        loss=0,
        transient=gathered + recomputed,
    )


def step_estimate(shape: ModelShape, parallel: Parallel, options: StepOptions, vision: VisionTower | None = None) -> MemoryEstimate:
    """`estimate` of the decoder plus, for a VLM, `vision_estimate` of its tower."""
    text = estimate(shape, parallel, options)
    if vision is None:
        return text
    tower = vision_estimate(vision, parallel, options)
    return MemoryEstimate(**{key: getattr(text, key) + getattr(tower, key) for key in asdict(text)})


def describe_vision(tower: dict[str, Any]) -> list[str]:
    """The vision tower's memory line under `describe`'s; `tower`: `plan`'s `vision_tower`
    (`layout`, `image_tokens`, `patches_per_rank`, `cp`, `memory_per_rank` from `vision_estimate`)."""
    if tower["image_tokens"]:
        step = f"{tower['image_tokens']} image tokens per micro-step, {tower['patches_per_rank']} patches per rank"
        if tower["cp"] > 1:
            step += f", assumed split evenly over the cp {tower['cp']} ranks"
    else:
        step = "a text-only step: --image-tokens 0" + (
            f", the placeholder image's {tower['patches_per_rank']} patches" if tower["layout"] == "units" else "")
    memory = tower["memory_per_rank"]
    return [f"  of which vision tower ({step}): "
            + ", ".join(f"{key} {_gib(value)}" for key, value in memory.items() if key not in ("loss", "total"))]
