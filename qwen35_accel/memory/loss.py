"""What the lm_head and the cross entropy keep for backward (`loss_saved`) and use beyond it at
their peak (`loss_transient`): the tiled loss in each mode, or Transformers' loss."""

from __future__ import annotations

from .shapes import DEFAULT_LOSS_TILE_BYTES, ModelShape, Parallel, StepOptions


def loss_tile_tokens(vocab_local: int, tile_bytes: int = DEFAULT_LOSS_TILE_BYTES) -> int:
    """Tokens per loss tile, as the tiled loss takes them (`parallel.tiled_head.token_tile_size`)."""
    from ..parallel.tiled_head import token_tile_size

    return token_tile_size(vocab_local, tile_bytes)



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
