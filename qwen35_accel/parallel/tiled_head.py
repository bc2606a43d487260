"""The lm_head and next-token statistics in tiles of tokens: `[tokens, vocab]` never exists whole.

At Qwen3.5's 248,320-token vocabulary one fp32 row of logits is ~970 KiB, more than the whole
checkpointed decoder keeps per token. Two functions project `tile` tokens at a time through
the lm_head and drop each tile once used:
- `linear_token_stats`: per-token statistics (log-probability of the target, optionally
  entropy, top-1, ...) with any upstream gradient; backward recomputes each tile. Saved for
  backward: the hidden states, the targets and two fp32 numbers per token. (TRL's fused head.)
- `linear_cross_entropy_sum`: the summed cross entropy (the training loss), in one of two
  modes (`LOSS_MODES`). "hold" (the default): the gradients are computed tile by tile in
  forward and only scaled in backward (three GEMMs per tile, as with whole logits); held for
  backward: the gradients of hidden states, weight and bias (the lm_head weight's size,
  whatever the length; the gradients every path makes first in backward, so a step's peak
  is the same). "recompute": forward keeps each token's log-sum-exp and backward recomputes
  each tile's logits (one GEMM per tile in forward, three in backward); saved for backward:
  the hidden states, the targets and one fp32 number per token.

With a vocab-parallel lm_head (`group`: each rank holds rows `vocab_start : vocab_start + V/tp`
of the weight) the per-token statistics are combined over the group (one max, one sum and,
for top-1, one min all-reduce of [tokens] vectors per call; nothing of size vocab crosses
ranks), and the hidden states' gradient is summed over the group in backward.

Numerics follow Transformers' path: the logits are computed in the compute dtype (the inputs'
dtype, or autocast's) and upcast to fp32, as `lm_head(hidden).float()` in its loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# Per-token outputs besides the target's log-probability, computed only when asked for.
OPTIONAL_STATS: tuple[str, ...] = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# One tile's fp32 logits take at most this many bytes (about 270 tokens at vocab 248,320).
TILE_BYTES = 2**28


def token_tile_size(local_vocab: int, tile_bytes: int = TILE_BYTES) -> int:
    """Tokens per tile: the most, in multiples of 8 (at least 8), whose fp32 logits
    `[tile, local_vocab]` fit in `tile_bytes`."""
    if local_vocab <= 0 or tile_bytes <= 0:
        raise ValueError(f"token_tile_size needs a positive vocab and byte budget; got {local_vocab}, {tile_bytes}")
    return max(8, tile_bytes // (4 * local_vocab) // 8 * 8)


def lm_head_weights(lm_head: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lm_head's (weight, bias) as its own forward would use them, after running the
    module on zero tokens: its hooks gather an FSDP2 unit of its own (a tail split by dtype)
    and register it for the end of backward's reduce-scatter, which reading `.weight` alone
    would skip (leaving a sharded DTensor). The zero tokens are a tensor of their own: a
    view of `hidden_states` would be saved by the module's backward and keep its storage."""
    lm_head(hidden_states.new_empty((0, hidden_states.shape[-1])))
    return lm_head.weight, lm_head.bias


class TokenStats(NamedTuple):
    """Per-token statistics of the next-token distribution, each `[tokens]` (None if not asked for).

    `log_probs` (fp32, differentiable): log-probability of the target; `entropy` (fp32,
    differentiable); `log_sum_sq_probs` (fp32): log Σ p²; `mean_logits` (fp32): the mean
    logit over the whole vocab; `is_top1` (bool): the target is the first index of the max.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _tile_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_temperature: float
) -> torch.Tensor:
    """[tile, V_local] fp32 logits of `hidden` (already in the compute dtype) / temperature."""
    with torch.autocast(hidden.device.type, enabled=False):
        z = F.linear(hidden, weight, bias).float()
    return z if inv_temperature == 1.0 else z * inv_temperature


def _in_compute_dtype(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _local_targets(targets: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's row in this rank's slice, clamped into it; whether the slice holds it)."""
    local = targets - vocab_start
    mine = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), mine


def _zero_grads(
    needs: tuple[bool, ...], h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """fp32 accumulators for the gradients of hidden, weight and bias that autograd needs."""
    return tuple(  # type: ignore[return-value]
        torch.zeros(t.shape, device=t.device, dtype=torch.float32) if need and t is not None else None
        for need, t in zip(needs[:3], (h, w, b))
    )


Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]

# Under a low-precision compute dtype the weight's gradient is one GEMM per tile in that dtype
# (as Transformers' backward computes it), added to the fp32 accumulator in slices of rows
# whose product takes at most this many bytes.
WEIGHT_GRAD_SLICE_BYTES = 2**26


def _add_tile_grads(grads: Grads, g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, start: int, end: int) -> None:
    """Add one tile's share to the fp32 accumulators `grads` (of hidden, weight, bias), from
    `g` = d(output)/d(logits) [tile, V_local] fp32 of the rows `h[start:end]`.

    The GEMMs run in the compute dtype (`w`'s and `h`'s), with its fast kernels: `g` is cast
    to it as Transformers casts the logits' gradient. An fp32 weight gradient accumulates in
    place; in a 16-bit dtype each tile's product (fp32 accumulation inside the GEMM, rounded
    once) is added to the fp32 accumulator, `WEIGHT_GRAD_SLICE_BYTES` of rows at a time."""
    grad_hidden, grad_weight, grad_bias = grads
    g_c = g.to(w.dtype)
    if grad_hidden is not None:
        grad_hidden[start:end] = torch.mm(g_c, w).float()
    if grad_weight is not None:
        h_tile = h[start:end]
        if w.dtype == torch.float32:
            grad_weight.addmm_(g_c.t(), h_tile)
        else:
            rows = max(1, WEIGHT_GRAD_SLICE_BYTES // (h.shape[1] * h.element_size()))
            for first in range(0, grad_weight.shape[0], rows):
                grad_weight[first : first + rows] += torch.mm(g_c[:, first : first + rows].t(), h_tile)
    if grad_bias is not None:
        grad_bias += g.sum(dim=0)


def _scale_(t: torch.Tensor, scale: torch.Tensor, slice_bytes: int = WEIGHT_GRAD_SLICE_BYTES) -> torch.Tensor:
    """`t` times the fp32 scalar `scale`, in place and rounded once to `t`'s dtype; a 16-bit
    `t` is scaled in fp32 slices of at most `slice_bytes`, so no second tensor of its size
    exists."""
    if t.dtype == torch.float32:
        return t.mul_(scale)
    flat = t.view(-1, t.shape[-1]) if t.dim() > 1 else t.view(1, -1)
    rows = max(1, slice_bytes // (flat.shape[1] * 4))
    for part in flat.split(rows):
        part.copy_(part.float() * scale)
    return t


def _finish_grads(
    grads: Grads, group: dist.ProcessGroup | None, dtypes: tuple[torch.dtype | None, ...], scale: torch.Tensor | None = None
) -> Grads:
    """The accumulated gradients summed over the vocab group (hidden's: each rank's vocab
    slice contributes), times `scale` (the upstream gradient) if given, in `dtypes`."""
    grad_hidden = grads[0]
    if grad_hidden is not None and group is not None:
        dist.all_reduce(grad_hidden, group=group)
    if scale is not None:
        for g in grads:
            if g is not None:
                g.mul_(scale.to(torch.float32))
    return tuple(None if g is None else g.to(dtype) for g, dtype in zip(grads, dtypes))  # type: ignore[return-value]


def _dtypes(*tensors: torch.Tensor | None) -> tuple[torch.dtype | None, ...]:
    return tuple(None if t is None else t.dtype for t in tensors)


class _LinearTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        vocab_size: int,
        temperature: float,
        tile: int,
        outputs: tuple[str, ...],
    ) -> tuple[torch.Tensor | None, ...]:
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(hidden)
        h, w, b = _in_compute_dtype(hidden, weight, bias, dtype)
        n, local_vocab = h.shape[0], w.shape[0]
        inv_t = 1.0 / temperature
        f32 = dict(device=h.device, dtype=torch.float32)
        local_max, sum_exp, target_logit = (torch.zeros(n, **f32) for _ in range(3))
        extra = {name: torch.zeros(n, **f32) for name in ("entropy", "log_sum_sq_probs", "mean_logits") if name in outputs}
        argmax = torch.zeros(n, device=h.device, dtype=torch.long) if "is_top1" in outputs else None
        local_targets, mine = _local_targets(targets, vocab_start, local_vocab)
        for start in range(0, n, tile):
            end = min(start + tile, n)
            z = _tile_logits(h[start:end], w, b, inv_t)
            top = z.max(dim=-1)
            e = (z - top.values.unsqueeze(-1)).exp()
            local_max[start:end] = top.values
            sum_exp[start:end] = e.sum(dim=-1)
            target_logit[start:end] = z.gather(1, local_targets[start:end, None]).squeeze(1)
            if "entropy" in extra:  # Σ e·(z - max): no cancellation against a large max when H is small
                extra["entropy"][start:end] = (e * (z - top.values.unsqueeze(-1))).sum(dim=-1)
            if "log_sum_sq_probs" in extra:
                extra["log_sum_sq_probs"][start:end] = (e * e).sum(dim=-1)
            if "mean_logits" in extra:
                extra["mean_logits"][start:end] = z.sum(dim=-1)
            if argmax is not None:
                argmax[start:end] = top.indices + vocab_start
            del z, e
        target_logit = target_logit * mine
        row_max = local_max
        if group is not None:
            row_max = local_max.clone()
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            scale = (local_max - row_max).exp()
            # Sums of e = exp(z - local max) move to the group's max M: Σ e by scale, Σ e² by
            # scale², Σ e·(z - max) to scale·(Σ e·(z - max) + (max - M)·Σ e).
            sums = {"sum_exp": sum_exp * scale, "target_logit": target_logit}
            if "entropy" in extra:
                sums["entropy"] = scale * (extra["entropy"] + (local_max - row_max) * sum_exp)
            if "log_sum_sq_probs" in extra:
                sums["log_sum_sq_probs"] = extra["log_sum_sq_probs"] * scale * scale
            if "mean_logits" in extra:
                sums["mean_logits"] = extra["mean_logits"]
            stacked = torch.stack(list(sums.values()))
            dist.all_reduce(stacked, group=group)
            sums = dict(zip(sums, stacked.unbind(0)))
            sum_exp, target_logit = sums.pop("sum_exp"), sums.pop("target_logit")
            extra = sums
            if argmax is not None:  # the first index of the global max: the smallest among ranks attaining it
                argmax = torch.where(local_max == row_max, argmax, torch.full_like(argmax, vocab_size))
                dist.all_reduce(argmax, op=dist.ReduceOp.MIN, group=group)
        log_z = row_max + sum_exp.log()
        log_probs = target_logit - log_z
        entropy = sum_exp.log() - extra["entropy"] / sum_exp if "entropy" in extra else None
        log_sum_sq = extra["log_sum_sq_probs"].log() - 2 * sum_exp.log() if "log_sum_sq_probs" in extra else None
        mean_logits = extra["mean_logits"] / vocab_size if "mean_logits" in extra else None
        is_top1 = argmax == targets if argmax is not None else None

        ctx.save_for_backward(hidden, weight, bias, local_targets, mine, log_z, entropy)
        ctx.group, ctx.dtype, ctx.inv_t, ctx.tile = group, dtype, inv_t, tile
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean_logits, is_top1) if x is not None))
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_: object):  # type: ignore[override]
        hidden, weight, bias, local_targets, mine, log_z, entropy = ctx.saved_tensors
        h, w, b = _in_compute_dtype(hidden, weight, bias, ctx.dtype)
        n = h.shape[0]
        grads = _zero_grads(ctx.needs_input_grad, h, w, b)
        for start in range(0, n, ctx.tile):
            end = min(start + ctx.tile, n)
            z = _tile_logits(h[start:end], w, b, ctx.inv_t)
            log_p = z - log_z[start:end, None]
            p = log_p.exp()
            g = torch.zeros_like(z)
            if grad_log_probs is not None:  # d log p_target / dz_j = 1[j = target] - p_j
                gl = grad_log_probs[start:end].float()
                g -= gl[:, None] * p
                g.scatter_add_(1, local_targets[start:end, None], (gl * mine[start:end])[:, None])
            if grad_entropy is not None:  # d H / dz_j = -p_j (log p_j + H)
                g -= grad_entropy[start:end].float()[:, None] * p * (log_p + entropy[start:end, None])
            del z, log_p, p
            if ctx.inv_t != 1.0:
                g *= ctx.inv_t
            _add_tile_grads(grads, g, h, w, start, end)
        return (*_finish_grads(grads, ctx.group, _dtypes(hidden, weight, bias)), *(None,) * 7)


def linear_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    outputs: tuple[str, ...] = (),
    tile: int | None = None,
) -> TokenStats:
    """Next-token statistics of `hidden @ weight.T + bias` for every row, in tiles of `tile` tokens.

    `hidden`: [N, H]; `weight`: [V_local, H] (the lm_head's rows this rank holds: all of them
    without `group`, rank r's contiguous V/tp slice with it); `bias`: [V_local] or None;
    `targets`: [N] int64 global vocab ids, every one valid (pass only labelled rows);
    `outputs`: names from `OPTIONAL_STATS` to compute besides `log_probs`; `tile`: tokens per
    tile (default `token_tile_size`). Collective over `group`: every rank passes the same
    `hidden` and `targets`. Differentiable in `hidden`, `weight`, `bias` through `log_probs`
    and `entropy`.
    """
    unknown = set(outputs) - set(OPTIONAL_STATS)
    if unknown:
        raise ValueError(f"unknown outputs {sorted(unknown)}; expected names from {OPTIONAL_STATS}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    local_vocab = weight.shape[0]
    tp = 1 if group is None else dist.get_world_size(group)
    vocab_start = 0 if group is None else dist.get_rank(group) * local_vocab
    tile = tile or token_tile_size(local_vocab)
    stats = _LinearTokenStats.apply(
        hidden, weight, bias, targets, group, vocab_start, local_vocab * tp, temperature, tile, tuple(outputs)
    )
    return TokenStats(*stats)


def _tile_softmax(
    z: torch.Tensor, local_targets: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's fp32 logits `z` [tile, V_local] turned in place into exp(z - M), M the row's
    max over the whole vocab; returns (exp(z - M), M, Σ exp(z - M) over the whole vocab,
    target logit - M), the last three [tile]. Over `group`: a max and a sum all-reduce of
    [tile] vectors."""
    row_max = z.max(dim=-1).values
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    z -= row_max.unsqueeze(-1)
    target_logit = z.gather(1, local_targets[:, None]).squeeze(1) * mine
    p = z.exp_()
    sums = torch.stack([p.sum(dim=-1), target_logit])
    if group is not None:
        dist.all_reduce(sums, group=group)
    sum_exp, target_logit = sums.unbind(0)
    return p, row_max, sum_exp, target_logit


def _cross_entropy_grad_(p: torch.Tensor, local_targets: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """d(-log p_target)/dz = p - 1[target], in place in the probabilities `p` [tile, V_local]."""
    return p.scatter_add_(1, local_targets[:, None], -mine[:, None].to(p.dtype))


LOSS_MODES: tuple[str, ...] = ("hold", "recompute")
# The default: at a step's peak both modes hold the same bytes (what "hold" keeps are the
# gradients every path makes at the start of backward), and "hold" runs one GEMM fewer.
DEFAULT_LOSS_MODE = "hold"


class _LinearCrossEntropySum(torch.autograd.Function):
    """Σ -log p(target) over the rows. `hold`: every gradient is computed tile by tile in
    forward and held (the upstream gradient of a scalar only scales them), three GEMMs per
    tile in all. Otherwise ("recompute") forward keeps one log-sum-exp per token and backward
    recomputes each tile's logits, four GEMMs per tile in all."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        tile: int,
        hold: bool,
    ) -> torch.Tensor:
        dtype = _compute_dtype(hidden)
        h, w, b = _in_compute_dtype(hidden, weight, bias, dtype)
        n, local_vocab = h.shape[0], w.shape[0]
        grads = _zero_grads(ctx.needs_input_grad, h, w, b) if hold else (None, None, None)
        log_z = None if hold else torch.empty(n, device=h.device, dtype=torch.float32)
        local_targets, mine = _local_targets(targets, vocab_start, local_vocab)
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        for start in range(0, n, tile):
            end = min(start + tile, n)
            z = _tile_logits(h[start:end], w, b, 1.0)
            p, row_max, sum_exp, target_logit = _tile_softmax(z, local_targets[start:end], mine[start:end], group)
            total += (sum_exp.log() - target_logit).sum()
            if log_z is not None:
                log_z[start:end] = row_max + sum_exp.log()
            else:
                p /= sum_exp.unsqueeze(-1)
                _add_tile_grads(grads, _cross_entropy_grad_(p, local_targets[start:end], mine[start:end]), h, w, start, end)
            del z, p
        ctx.hold, ctx.group, ctx.vocab_start, ctx.tile, ctx.dtype = hold, group, vocab_start, tile, dtype
        ctx.dtypes = _dtypes(hidden, weight, bias)
        # Saved as tensors (not ctx attributes), so saved-tensor hooks and offloading see them.
        if hold:
            grads = _finish_grads(grads, group, ctx.dtypes)
            ctx.present = tuple(g is not None for g in grads)
            ctx.save_for_backward(*(g for g in grads if g is not None))
        else:  # the inputs as given (no copy), the targets and [N] fp32
            ctx.save_for_backward(hidden, weight, bias, targets, log_z)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):  # type: ignore[override]
        if ctx.hold:  # the held gradients scaled in place: no second copy of the weight's size
            saved = iter(ctx.saved_tensors)
            scale = grad_total.to(torch.float32)
            grads = tuple(_scale_(next(saved), scale) if present else None for present in ctx.present)
            return (*grads, *(None,) * 5)
        hidden, weight, bias, targets, log_z = ctx.saved_tensors
        h, w, b = _in_compute_dtype(hidden, weight, bias, ctx.dtype)
        local_targets, mine = _local_targets(targets, ctx.vocab_start, w.shape[0])
        grads = _zero_grads(ctx.needs_input_grad, h, w, b)
        for start in range(0, h.shape[0], ctx.tile):
            end = min(start + ctx.tile, h.shape[0])
            z = _tile_logits(h[start:end], w, b, 1.0)
            p = z.sub_(log_z[start:end, None]).exp_()
            _add_tile_grads(grads, _cross_entropy_grad_(p, local_targets[start:end], mine[start:end]), h, w, start, end)
            del z, p
        return (*_finish_grads(grads, ctx.group, ctx.dtypes, scale=grad_total), *(None,) * 5)


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    tile: int | None = None,
    mode: str = DEFAULT_LOSS_MODE,
) -> torch.Tensor:
    """Σ over rows of the cross entropy of `hidden @ weight.T + bias` against `targets`
    (fp32 scalar), in tiles of `tile` tokens; nothing of size tokens × vocab is kept.

    `mode` (`LOSS_MODES`): "hold" (the default) computes the gradients during forward and
    holds them until backward (`hidden`'s shape and the weight's and bias's, in their dtypes;
    three GEMMs per tile; backward scales them in place, so a second backward through the
    same graph raises); "recompute" saves for backward `hidden` and `targets` as given and
    one fp32 log-sum-exp per row, and recomputes each tile's logits in backward (four GEMMs
    per tile in all). Shapes and the vocab-parallel contract as `linear_token_stats`
    (collective over `group`: two [tile] all-reduces per tile in forward, and one [N, H] in
    forward with "hold", in backward with "recompute"). For the training loss; use
    `linear_token_stats` when the per-token values are needed.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if mode not in LOSS_MODES:
        raise ValueError(f"linear_cross_entropy_sum: mode {mode!r} is not one of {list(LOSS_MODES)}")
    local_vocab = weight.shape[0]
    vocab_start = 0 if group is None else dist.get_rank(group) * local_vocab
    tile = tile or token_tile_size(local_vocab)
    return _LinearCrossEntropySum.apply(hidden, weight, bias, targets, group, vocab_start, tile, mode == "hold")
