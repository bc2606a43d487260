"""What the lm_head and the cross entropy keep for backward (`loss_saved`) and use beyond it at
their peak (`loss_transient`): the tiled loss in each mode, or Transformers' loss."""

from __future__ import annotations

from .shapes import DEFAULT_LOSS_TILE_BYTES, ModelShape, Parallel, StepOptions


def loss_block(tokens: int, vocab_local: int, tile_bytes: int = DEFAULT_LOSS_TILE_BYTES) -> tuple[int, int]:
    """(tokens, vocab rows) per block of the tiled loss, as it takes them
    (`parallel.tiled_blocks.block_shape`), the tokens at most `tokens`."""
    from ..parallel.tiled_blocks import block_shape

    token_rows, vocab_rows = block_shape(tokens, vocab_local, tile_bytes)
    return min(token_rows, tokens), vocab_rows


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

    Tiled, in the gradient pass (forward with "hold", backward with "recompute"; vocab blocks
    outermost, `loss_block`): the fp32 accumulator of the hidden states' gradient, the weight's
    gradient in the compute dtype ("hold" holds it and, cast at the end, the hidden states':
    `loss_saved`), and one block's working bytes: its fp32 logits beside their copy in a
    16-bit compute dtype (the GEMM's output, then the gradient cast for the next GEMMs), or
    that copy beside a gradient product (`[rows, hidden]` in fp32, and on CPU first in the
    compute dtype), plus, over several token blocks, the weight rows' fp32 accumulator.
    Transformers' loss, in backward beside its saved fp32 log-softmax: two fp32 `[tokens,
    vocab]` gradients (the NLL's and the log-softmax's), more than forward's logits with
    their fp32 copy.
    """
    tokens = options.batch_size * options.seq_len // parallel.cp
    vocab = _vocab_local(shape, parallel)
    c = options.compute_bytes
    if options.tiled_loss == "off":
        return tokens * vocab * 8
    copies = 0 if c == 4 else c
    token_rows, vocab_rows = loss_block(tokens, vocab, options.loss_tile_bytes)
    block = token_rows * vocab_rows
    product = 0 if not copies else max(token_rows, vocab_rows) * shape.hidden * (4 + (c if options.device == "cpu" else 0))
    accumulator = vocab_rows * shape.hidden * 4 if copies and tokens > token_rows else 0
    working = max(block * (4 + copies), block * copies + product) + accumulator
    grad_hidden = tokens * shape.hidden * 4
    if options.tiled_loss == "hold":
        return working + (grad_hidden if copies else 0)
    return grad_hidden + vocab * shape.hidden * c + max(working, tokens * shape.hidden * copies)
