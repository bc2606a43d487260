"""The lm_head and next-token statistics in blocks: `[tokens, vocab]` never exists whole.

At Qwen3.5's 248,320-token vocabulary one fp32 row of logits is ~970 KiB, more than the whole
checkpointed decoder keeps per token. Two functions project blocks of `tile` tokens ×
`vocab_tile` lm_head rows (`tiled_blocks`: vocab blocks outermost, fp32 logits of at most
256 MiB a block) and drop each block once used:
- `linear_token_stats`: per-token statistics (log-probability of the target, optionally
  entropy, top-1, ...) with any upstream gradient; backward recomputes each block. Saved for
  backward: the hidden states, the targets and two fp32 numbers per token. (TRL's fused head.)
- `linear_cross_entropy_sum`: the summed cross entropy (the training loss), in one of two
  modes (`LOSS_MODES`). "recompute" (the default): forward keeps each token's log-sum-exp and
  backward recomputes each block's logits (one GEMM per block in forward, three in backward);
  saved for backward: the hidden states, the targets and one fp32 number per token. "hold":
  the gradients are computed in forward (the same four GEMMs) and only scaled in backward.

Both keep the lm_head weight as it is: a weight stored in another dtype than the compute
dtype (`cast_lm_head_to_fp32`, autocast) is cast one block at a time, and its gradient is
made block by block in its own dtype, each block's summed in fp32 over up to 4096 tokens a
GEMM and rounded once (never an fp32 accumulator of the weight's size).

With a vocab-parallel lm_head (`group`: each rank holds rows `vocab_start : vocab_start + V/tp`
of the weight) the per-token statistics of the ranks' slices are combined by one all-gather
of `[statistics, tokens]` fp32 per call (nothing of size vocab crosses ranks), and the hidden
states' gradient is summed over the group where it is computed.

Numerics follow Transformers' path: the logits are computed in the compute dtype (the inputs'
dtype, or autocast's) and upcast to fp32, as `lm_head(hidden).float()` in its loss; the
logits' gradient is cast to the compute dtype for the GEMMs, as its backward casts it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .options import TILED_LOSS_CHOICES
from .tiled_blocks import FIELDS, block_shape, combine_over_group, gradient_pass, stats_pass

# Per-token outputs besides the target's log-probability, computed only when asked for.
OPTIONAL_STATS: tuple[str, ...] = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# The block statistics (`tiled_blocks.FIELDS`) each optional output needs.
_STAT_FIELDS = {"entropy": "entropy", "log_sum_sq_probs": "sum_sq", "mean_logits": "sum_logits", "is_top1": "argmax"}


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


def _local_targets(targets: torch.Tensor, vocab_start: int, rows: slice) -> torch.Tensor:
    """Each target's row within the weight rows `rows` of this rank's slice, -1 if outside."""
    local = targets - (vocab_start + rows.start)
    return torch.where((local >= 0) & (local < rows.stop - rows.start), local, -1)


def _subtract_targets_(g: torch.Tensor, local: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`g` [tokens, rows] minus `weight` [tokens] at each token's target (`local`, -1: none here)."""
    return g.scatter_add_(1, local.clamp(min=0)[:, None], -(weight * (local >= 0))[:, None])


def _scale_(t: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` times the fp32 scalar `scale`, in place and rounded once to `t`'s dtype; a 16-bit
    `t` is scaled in fp32 slices of `rows` rows (a block's), so no second tensor of its size
    exists."""
    if t.dtype == torch.float32:
        return t.mul_(scale)
    for part in t.split(rows):
        part.copy_(part.float() * scale)
    return t


Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _finish_grads(grads: Grads, group: dist.ProcessGroup | None, hidden_dtype: torch.dtype) -> Grads:
    """`gradient_pass`'s gradients as autograd takes them: hidden's (fp32, this rank's vocab
    slice's share) summed over the vocab group and cast to `hidden_dtype`."""
    grad_h, grad_w, grad_b = grads
    if grad_h is not None:
        if group is not None:
            dist.all_reduce(grad_h, group=group)
        grad_h = grad_h.to(hidden_dtype)
    return grad_h, grad_w, grad_b


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
        block: tuple[int, int],
        outputs: tuple[str, ...],
    ) -> tuple[torch.Tensor | None, ...]:
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(hidden)
        wanted = {"max", "sum_exp", "target", *(_STAT_FIELDS[name] for name in outputs)}
        fields = tuple(name for name in FIELDS if name in wanted)
        inv_t = 1.0 / temperature
        stats = stats_pass(hidden.to(dtype), weight, bias, targets, dtype=dtype, vocab_start=vocab_start, block=block,
                           inv_temperature=inv_t, fields=fields)
        at = dict(zip(fields, combine_over_group(stats, fields, group).unbind(0)))
        log_sum = at["sum_exp"].log()
        log_z = at["max"] + log_sum
        log_probs = at["target"] - log_z
        entropy = log_sum - at["entropy"] / at["sum_exp"] if "entropy" in at else None
        log_sum_sq = at["sum_sq"].log() - 2 * log_sum if "sum_sq" in at else None
        mean_logits = at["sum_logits"] / vocab_size if "sum_logits" in at else None
        is_top1 = at["argmax"].long() == targets if "argmax" in at else None

        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy)
        ctx.group, ctx.dtype, ctx.inv_t, ctx.block, ctx.vocab_start = group, dtype, inv_t, block, vocab_start
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean_logits, is_top1) if x is not None))
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_: object):  # type: ignore[override]
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        gl = None if grad_log_probs is None else grad_log_probs.float()
        ge = None if grad_entropy is None else grad_entropy.float()

        def block_grad(z: torch.Tensor, tokens: slice, rows: slice) -> torch.Tensor:
            log_p = z.sub_(log_z[tokens, None])
            p = log_p.exp()
            g = torch.zeros_like(p)
            if gl is not None:  # d log p_target / dz_j = 1[j = target] - p_j
                g -= gl[tokens, None] * p
                _subtract_targets_(g, _local_targets(targets[tokens], ctx.vocab_start, rows), -gl[tokens])
            if ge is not None:  # d H / dz_j = -p_j (log p_j + H)
                g -= ge[tokens, None] * p * (log_p + entropy[tokens, None])
            return g

        grads = gradient_pass(hidden.to(ctx.dtype), weight, bias, ctx.needs_input_grad[:3], dtype=ctx.dtype, block=ctx.block,
                              inv_temperature=ctx.inv_t, block_grad=block_grad)
        return (*_finish_grads(grads, ctx.group, hidden.dtype), *(None,) * 7)


def _block(hidden: torch.Tensor, weight: torch.Tensor, tile: int | None, vocab_tile: int | None) -> tuple[int, int]:
    for name, value in (("tile", tile), ("vocab_tile", vocab_tile)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be a positive number of rows; got {value}")
    return block_shape(hidden.shape[0], weight.shape[0], tile=tile, vocab_tile=vocab_tile)


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
    vocab_tile: int | None = None,
) -> TokenStats:
    """Next-token statistics of `hidden @ weight.T + bias` for every row, in blocks of `tile`
    tokens × `vocab_tile` weight rows (default `tiled_blocks.block_shape`).

    `hidden`: [N, H]; `weight`: [V_local, H] (the lm_head's rows this rank holds: all of them
    without `group`, rank r's contiguous V/tp slice with it); `bias`: [V_local] or None;
    `targets`: [N] int64 global vocab ids, every one valid (pass only labelled rows);
    `outputs`: names from `OPTIONAL_STATS` to compute besides `log_probs`. Collective over
    `group` (one all-gather of `[statistics, N]` fp32 per call in forward, one [N, H]
    all-reduce in backward): every rank passes the same `hidden` and `targets`.
    Differentiable in `hidden`, `weight`, `bias` through `log_probs` and `entropy`.
    """
    unknown = set(outputs) - set(OPTIONAL_STATS)
    if unknown:
        raise ValueError(f"unknown outputs {sorted(unknown)}; expected names from {OPTIONAL_STATS}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    local_vocab = weight.shape[0]
    tp = 1 if group is None else dist.get_world_size(group)
    vocab_start = 0 if group is None else dist.get_rank(group) * local_vocab
    block = _block(hidden, weight, tile, vocab_tile)
    stats = _LinearTokenStats.apply(
        hidden, weight, bias, targets, group, vocab_start, local_vocab * tp, temperature, block, tuple(outputs)
    )
    return TokenStats(*stats)


LOSS_MODES: tuple[str, ...] = TILED_LOSS_CHOICES[1:]  # ("recompute", "hold"): the knob's choices but "off"
# The default: "hold" runs the same four GEMMs per block, and keeps the gradients (one of the
# lm_head weight's size) from forward to backward instead of the hidden states.
DEFAULT_LOSS_MODE = LOSS_MODES[0]  # "recompute"
_LOSS_FIELDS = ("max", "sum_exp", "target")


class _LinearCrossEntropySum(torch.autograd.Function):
    """Σ -log p(target) over the rows: forward one GEMM per block (`stats_pass`); the gradients
    (`gradient_pass`, three GEMMs per block) in backward ("recompute") or right after the
    statistics in forward, held until backward scales them ("hold")."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        block: tuple[int, int],
        hold: bool,
    ) -> torch.Tensor:
        dtype = _compute_dtype(hidden)
        h = hidden.to(dtype)
        stats = stats_pass(h, weight, bias, targets, dtype=dtype, vocab_start=vocab_start, block=block,
                           inv_temperature=1.0, fields=_LOSS_FIELDS)
        row_max, sum_exp, target_logit = combine_over_group(stats, _LOSS_FIELDS, group).unbind(0)
        log_z = row_max + sum_exp.log()
        total = (log_z - target_logit).sum()
        ctx.hold, ctx.group, ctx.vocab_start, ctx.block, ctx.dtype = hold, group, vocab_start, block, dtype
        ctx.hidden_dtype = hidden.dtype
        # Saved as tensors (not ctx attributes), so saved-tensor hooks and offloading see them.
        if hold:
            grads = _finish_grads(_loss_gradients(ctx, h, weight, bias, targets, log_z, None), group, hidden.dtype)
            ctx.present = tuple(g is not None for g in grads)
            ctx.save_for_backward(*(g for g in grads if g is not None))
        else:  # the inputs as given (no copy), the targets and [N] fp32
            ctx.save_for_backward(hidden, weight, bias, targets, log_z)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):  # type: ignore[override]
        scale = grad_total.to(torch.float32)
        if ctx.hold:  # the held gradients scaled in place: no second copy of the weight's size
            saved = iter(ctx.saved_tensors)
            rows = (ctx.block[0], ctx.block[1], ctx.block[1])  # hidden's, weight's and bias's slices
            grads = tuple(_scale_(next(saved), scale, n) if present else None for present, n in zip(ctx.present, rows))
            return (*grads, *(None,) * 5)
        hidden, weight, bias, targets, log_z = ctx.saved_tensors
        grads = _loss_gradients(ctx, hidden.to(ctx.dtype), weight, bias, targets, log_z, scale)
        return (*_finish_grads(grads, ctx.group, ctx.hidden_dtype), *(None,) * 5)


def _loss_gradients(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    log_z: torch.Tensor, scale: torch.Tensor | None) -> Grads:
    """The cross entropy's gradients, d/dz = (softmax - 1[target]) · `scale` (the upstream
    gradient, applied before the cast to the compute dtype as Transformers' backward does)."""

    def block_grad(z: torch.Tensor, tokens: slice, rows: slice) -> torch.Tensor:
        p = z.sub_(log_z[tokens, None]).exp_()
        g = _subtract_targets_(p, _local_targets(targets[tokens], ctx.vocab_start, rows), torch.ones_like(log_z[tokens]))
        return g if scale is None else g.mul_(scale)

    return gradient_pass(h, weight, bias, ctx.needs_input_grad[:3], dtype=ctx.dtype, block=ctx.block,
                         inv_temperature=1.0, block_grad=block_grad)


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    tile: int | None = None,
    vocab_tile: int | None = None,
    mode: str = DEFAULT_LOSS_MODE,
) -> torch.Tensor:
    """Σ over rows of the cross entropy of `hidden @ weight.T + bias` against `targets`
    (fp32 scalar), in blocks of `tile` tokens × `vocab_tile` weight rows (default
    `tiled_blocks.block_shape`: fp32 logits of at most 256 MiB); nothing of size tokens × vocab
    is kept, and nothing of the weight's size is made besides its gradient.

    `mode` (`LOSS_MODES`): "recompute" (the default) saves for backward `hidden` and `targets`
    as given and one fp32 log-sum-exp per row, and recomputes each block's logits in backward;
    "hold" computes the gradients in forward and holds them until backward (`hidden`'s shape
    and the weight's and bias's, in their dtypes; backward scales them in place, so a second
    backward through the same graph raises). Both run four GEMMs per block. Shapes and the
    vocab-parallel contract as `linear_token_stats` (collective over `group`: one all-gather of
    `[3, N]` fp32 per call, one [N, H] all-reduce where the gradients are computed).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if mode not in LOSS_MODES:
        raise ValueError(f"linear_cross_entropy_sum: mode {mode!r} is not one of {list(LOSS_MODES)}")
    vocab_start = 0 if group is None else dist.get_rank(group) * weight.shape[0]
    block = _block(hidden, weight, tile, vocab_tile)
    return _LinearCrossEntropySum.apply(hidden, weight, bias, targets, group, vocab_start, block, mode == "hold")
