"""The tiled lm_head's two passes over `[tokens, vocab]` in blocks of `tile` tokens × `vocab_tile`
rows of the weight, vocab blocks outermost: no tensor of the weight's size is made besides its
gradient (in the weight's own dtype), and no weight-sized accumulator is read and written per
tile of tokens.

- `stats_pass`: per-token softmax statistics (max, Σ exp, target logit, optionally the entropy's
  sum, Σ exp², Σ logits, argmax) merged block by block (`merge_stats`, the online softmax);
  over a vocab-parallel group one `all_gather` of the `[fields, tokens]` partials per call,
  merged in rank order (`combine_over_group`).
- `gradient_pass`: the gradients of hidden, weight and bias from each block's d(output)/d(logits)
  (a callback). A vocab block's weight gradient is complete after its token loop: summed over
  `tile` tokens per GEMM (at most `BLOCK_TOKENS`: the accumulator's traffic stays far below the
  GEMM's) into an fp32 block accumulator, rounded once into the weight's dtype. The hidden
  states' gradient accumulates in fp32 over the vocab blocks.

The GEMMs run in the compute dtype; their products are taken in fp32 where the device can
(`torch.mm(..., out_dtype=torch.float32)` on CUDA: fp32 accumulation inside the GEMM, no
rounding before the sum) and are rounded once per block product otherwise (CPU 16-bit).
A weight stored in another dtype than the compute dtype (`cast_lm_head_to_fp32`, autocast)
is cast one vocab block at a time.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import all_gather_flat

# One block's fp32 logits take at most this many bytes.
TILE_BYTES = 2**28
# Tokens per block at most: the weight gradient's GEMM sums this many tokens into its fp32
# block accumulator (read and written once per GEMM): at 4096 tokens its traffic is under a
# hundredth of the GEMM's time on any current accelerator.
BLOCK_TOKENS = 4096
# The statistics a pass can merge, in this order in the `[fields, tokens]` tensors.
FIELDS: tuple[str, ...] = ("max", "sum_exp", "target", "entropy", "sum_sq", "sum_logits", "argmax")
# The argmax travels as fp32 with the other statistics: exact below 2**24.
_EXACT_INDEX = 2**24


def block_shape(
    tokens: int, local_vocab: int, tile_bytes: int = TILE_BYTES, tile: int | None = None, vocab_tile: int | None = None
) -> tuple[int, int]:
    """(tokens, vocab rows) per block: `tile` or up to `BLOCK_TOKENS` tokens (a multiple of 8),
    and `vocab_tile` or the most rows (the whole local vocab, else a multiple of 8, at least 8)
    whose fp32 logits `[tokens, rows]` fit in `tile_bytes`."""
    if local_vocab <= 0 or tile_bytes <= 0:
        raise ValueError(f"block_shape needs a positive vocab and byte budget; got {local_vocab}, {tile_bytes}")
    token_rows = tile or max(8, min(BLOCK_TOKENS, -(-tokens // 8) * 8))
    if vocab_tile:
        return token_rows, min(vocab_tile, local_vocab)
    if token_rows * local_vocab * 4 <= tile_bytes:
        return token_rows, local_vocab
    return token_rows, min(local_vocab, max(8, tile_bytes // (4 * token_rows) // 8 * 8))


def block_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_temperature: float
) -> torch.Tensor:
    """[tokens, rows] fp32 logits / temperature of `hidden` and a block of weight rows, both
    already in the compute dtype (Transformers' `lm_head(hidden).float()`)."""
    with torch.autocast(hidden.device.type, enabled=False):
        z = F.linear(hidden, weight, bias).float()
    return z if inv_temperature == 1.0 else z.mul_(inv_temperature)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` in fp32 from operands in the compute dtype (see the module's docstring)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b).float()


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    else:
        acc += _product(a, b)


def _block_stats(z: torch.Tensor, local_targets: torch.Tensor, first_index: int, fields: tuple[str, ...]) -> torch.Tensor:
    """`[fields, tokens]` statistics of one block's fp32 logits `z` (overwritten), relative to
    the block's own max; `local_targets`: each token's target row in the block, -1 if outside."""
    inside = local_targets >= 0
    top = z.max(dim=-1)
    rows = {"max": top.values, "target": z.gather(1, local_targets.clamp(min=0)[:, None]).squeeze(1) * inside}
    if "sum_logits" in fields:
        rows["sum_logits"] = z.sum(dim=-1)
    if "argmax" in fields:  # the first index of the max
        rows["argmax"] = (top.indices + first_index).float()
    z -= top.values.unsqueeze(-1)
    e = z.exp() if "entropy" in fields else z.exp_()
    rows["sum_exp"] = e.sum(dim=-1)
    if "entropy" in fields:  # Σ e·(z - max): no cancellation against a large max when H is small
        rows["entropy"] = (e * z).sum(dim=-1)
    if "sum_sq" in fields:
        rows["sum_sq"] = (e * e).sum(dim=-1)
    return torch.stack([rows[name] for name in fields])


def merge_stats(a: torch.Tensor, b: torch.Tensor, fields: tuple[str, ...]) -> torch.Tensor:
    """The statistics of two disjoint vocab ranges, `a` before `b` (`[fields, tokens]` each),
    as one range's: sums move from each range's max to the common max M (Σ e by exp(max - M),
    Σ e² by its square, Σ e·(z - max) to exp(max - M)·(Σ e·(z - max) + (max - M)·Σ e)); the
    argmax is `b`'s only where its max is larger (ties: the first index wins)."""
    at = dict(zip(fields, a.unbind(0)))
    bt = dict(zip(fields, b.unbind(0)))
    m = torch.maximum(at["max"], bt["max"])
    ra, rb = (at["max"] - m).exp(), (bt["max"] - m).exp()
    out = {"max": m, "sum_exp": ra * at["sum_exp"] + rb * bt["sum_exp"], "target": at["target"] + bt["target"]}
    if "entropy" in at:
        out["entropy"] = (ra * (at["entropy"] + (at["max"] - m) * at["sum_exp"])
                          + rb * (bt["entropy"] + (bt["max"] - m) * bt["sum_exp"]))
    if "sum_sq" in at:
        out["sum_sq"] = ra * ra * at["sum_sq"] + rb * rb * bt["sum_sq"]
    if "sum_logits" in at:
        out["sum_logits"] = at["sum_logits"] + bt["sum_logits"]
    if "argmax" in at:
        out["argmax"] = torch.where(bt["max"] > at["max"], bt["argmax"], at["argmax"])
    return torch.stack([out[name] for name in fields])


def stats_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    dtype: torch.dtype,
    vocab_start: int,
    block: tuple[int, int],
    inv_temperature: float,
    fields: tuple[str, ...],
) -> torch.Tensor:
    """`[fields, N]` fp32 statistics of this rank's vocab slice (`weight` [V_local, H]) for
    `hidden` [N, H] (already in `dtype`) and global `targets` [N]; one GEMM per block."""
    if "argmax" in fields and vocab_start + weight.shape[0] >= _EXACT_INDEX:
        raise ValueError(f"the top-1 statistic supports vocabularies below {_EXACT_INDEX} rows; got {vocab_start + weight.shape[0]}")
    n, (token_rows, vocab_rows) = hidden.shape[0], block
    acc = torch.zeros(len(fields), n, device=hidden.device, dtype=torch.float32)
    for v0 in range(0, weight.shape[0], vocab_rows):
        v1 = min(v0 + vocab_rows, weight.shape[0])
        w_b, b_b = weight[v0:v1].to(dtype), None if bias is None else bias[v0:v1].to(dtype)
        local = targets - (vocab_start + v0)
        local = torch.where((local >= 0) & (local < v1 - v0), local, -1)
        for c0 in range(0, n, token_rows):
            c1 = min(c0 + token_rows, n)
            part = _block_stats(block_logits(hidden[c0:c1], w_b, b_b, inv_temperature), local[c0:c1], vocab_start + v0, fields)
            acc[:, c0:c1] = part if v0 == 0 else merge_stats(acc[:, c0:c1], part, fields)
    return acc


def combine_over_group(stats: torch.Tensor, fields: tuple[str, ...], group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole vocabulary's statistics from every rank's slice: one `all_gather` of the
    `[fields, N]` partials, merged in rank order (every rank computes the same result)."""
    if group is None:
        return stats
    size = dist.get_world_size(group)
    gathered = stats.new_empty((size * stats.shape[0], stats.shape[1]))
    all_gather_flat(gathered, stats.contiguous(), group=group)
    gathered = gathered.view(size, *stats.shape)
    out = gathered[0]
    for rank in range(1, size):
        out = merge_stats(out, gathered[rank], fields)
    return out


# d(output)/d(logits) of one block: (fp32 logits [tokens, rows] to overwrite, token range,
# vocab row range) → fp32 [tokens, rows].
BlockGrad = Callable[[torch.Tensor, slice, slice], torch.Tensor]


def gradient_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
    *,
    dtype: torch.dtype,
    block: tuple[int, int],
    inv_temperature: float,
    block_grad: BlockGrad,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(gradient of `hidden` in fp32 — this rank's vocab slice's share —, of `weight` and of
    `bias` in their own dtypes) for those `needs` asks for; three GEMMs per block (the logits,
    then both gradients from `block_grad`'s output cast to `dtype`). `hidden` in `dtype`."""
    n, (token_rows, vocab_rows) = hidden.shape[0], block
    grad_h = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if needs[0] else None
    # No tokens (a rank whose rows hold no label): no block writes the weight's gradient.
    grad_w = (torch.zeros_like(weight) if n == 0 else torch.empty_like(weight)) if needs[1] else None
    grad_b = torch.empty_like(bias) if needs[2] and bias is not None else None
    one_chunk = n <= token_rows
    for v0 in range(0, weight.shape[0], vocab_rows):
        rows = slice(v0, min(v0 + vocab_rows, weight.shape[0]))
        w_b, b_b = weight[rows].to(dtype), None if bias is None else bias[rows].to(dtype)
        acc_w = None  # an fp32 weight gradient from fp32 GEMMs accumulates in place
        if grad_w is not None and grad_w.dtype == dtype == torch.float32:
            acc_w = grad_w[rows].zero_()
        elif grad_w is not None and not one_chunk:
            acc_w = w_b.new_zeros(w_b.shape, dtype=torch.float32)
        acc_b = None if grad_b is None else torch.zeros(w_b.shape[0], device=w_b.device, dtype=torch.float32)
        for c0 in range(0, n, token_rows):
            tokens = slice(c0, min(c0 + token_rows, n))
            h_c = hidden[tokens]
            g = block_grad(block_logits(h_c, w_b, b_b, inv_temperature), tokens, rows)
            if inv_temperature != 1.0:
                g *= inv_temperature
            if acc_b is not None:
                acc_b += g.sum(dim=0)
            g_c = g.to(dtype)  # as Transformers' backward casts the logits' gradient
            del g
            if grad_h is not None:
                _accumulate(grad_h[tokens], g_c, w_b)
            if grad_w is not None:
                if acc_w is None:  # one GEMM over every token: rounded once into the weight's dtype
                    grad_w[rows].copy_(_product(g_c.t(), h_c))
                else:
                    _accumulate(acc_w, g_c.t(), h_c)
            del g_c
        if acc_w is not None and grad_w is not None and acc_w.data_ptr() != grad_w[rows].data_ptr():
            grad_w[rows].copy_(acc_w)
        if acc_b is not None and grad_b is not None:
            grad_b[rows].copy_(acc_b)
    return grad_h, grad_w, grad_b
