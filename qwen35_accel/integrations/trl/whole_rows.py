"""TRL's preference trainers (DPO, KTO) under context parallelism: log-probabilities of whole rows.

TRL 1.16's `DPOTrainer` and `KTOTrainer` compute every per-sequence quantity (sums over the
completion, its length, ratios to the reference) from the per-token fields of
`model(..., labels=labels, fused_lm_head=True)` on whole rows; the head shifts `labels` inside
the row. Under qwen35_accel's context parallelism these trainers keep that form:

- The Trainer does not shard their batches (`step_hooks.prepare_context_parallel_inputs`): every
  rank of a cp group holds the same whole rows, as Accelerate's data loader hands them out.
- A fused-head call with unshifted `labels` (TRL's whole-row form; the Trainer's own CP sharding
  passes `shift_labels`) is sharded on entry (`shard_whole_rows`, a forward pre-hook ahead of the
  CP model's input checks): the labels shifted over the whole row, the rows right-padded to a
  multiple of 2·cp (the layout, never the numerics) and cut into our load-balanced chunks; each
  rank runs only its own chunks (the decoder is not replicated).
- `gather_whole_rows` all-gathers the per-token fields over cp and cuts them to TRL's
  `[rows, seq - 1]`, so TRL's sums, means and lengths run unchanged. Gradients flow back to each
  rank's chunks: every cp rank computes the same loss on the same whole rows, the gather's backward
  sums those cp identical gradients of each chunk, and FSDP2's mean over the cp ranks divides them
  again (exact for cp a power of two).
- Inside these trainers' loss and reference precompute, TRL's metric gathers
  (`Accelerator.gather`, and `gather_for_metrics` through it) count each row once
  (`counted_once_per_cp_group`): the cp ranks' identical copies are dropped, so token counts,
  precomputed reference log-probs and means are one process's (dp as TRL has them; tp: TRL
  divides its token count by tp, and the reference precompute drops the tp copies too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ...parallel.collectives import all_gather_flat
from ...parallel.losses import IGNORE_INDEX
from ...parallel.mesh import mesh_dim_size
from ..activation import TRL
from .trainers import TRL_WHOLE_ROW_TRAINERS

WHOLE_ROWS_KWARG = "_qwen35_accel_whole_rows"  # the sharded call's record, consumed by the fused-head forward
_PRE_HOOK_ATTR = "_qwen35_accel_whole_rows_hook"
# Per-token fields of TRL 1.16's `FusedCausalLMOutput`, gathered over cp (`label_mask` is rebuilt).
_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# Whole-row keys `shard_batch` shards (or passes whole, as the CP model reads them).
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")


def whole_rows_supported(trainer: str) -> tuple[bool, str | None]:
    """(whether `trainer` runs on whole rows under qwen35_accel's CP, the installed TRL version):
    DPOTrainer and KTOTrainer with TRL in the tested range (`activation.TRL`)."""
    ok, version = TRL.check()
    return ok and trainer in TRL_WHOLE_ROW_TRAINERS, version


@dataclasses.dataclass(frozen=True)
class WholeRows:
    """What a sharded whole-row call needs to give TRL its whole rows back."""

    cp_mesh: DeviceMesh
    seq: int  # the rows' length before padding
    label_mask: torch.Tensor  # [rows, seq - 1] bool: TRL's label mask of the whole rows
    lead: torch.Tensor | None = None  # [rows] long: left padding moved to the row's end (`_left_align`), or None


def _left_align(kwargs: dict[str, Any], seq: int) -> torch.Tensor | None:
    """Left-padded rows (GRPO's prompts are; the completions right-padded after them) made
    right-padded in place in `kwargs`, as CP takes them: each row's leading padding moved to
    its end, `position_ids` kept as the row had them (arange over the padded row when absent),
    the moved padding continuing them. A change of layout only: a leading padded token adds
    nothing to GatedDeltaNet's state (its input is zeroed) and no attention reads it, and
    rotary positions are kept. Returns the rows' leading pad counts [rows] (None when no row
    starts with padding). NotImplementedError when a label would be scored from a padded
    position (the first real token labelled: stock scores it from a pad's hidden state)."""
    mask = kwargs.get("attention_mask")
    if mask is None:
        return None
    mask = mask.bool()
    lead = (mask.long().cumsum(1) == 0).sum(1)  # [rows] leading padded tokens
    if not bool(lead.any()):
        return None
    labels = kwargs["labels"]
    column = torch.arange(seq, device=mask.device)
    scored_from_pad = (column[1:] <= lead[:, None]) & (labels[:, 1:] != IGNORE_INDEX)
    if bool(scored_from_pad.any()):
        raise NotImplementedError(
            "TRL's fused head on left-padded rows under context parallelism: a label is set on a row's first real token "
            f"(rows {sorted(set(scored_from_pad.nonzero()[:, 0].tolist()))}), which one process would score from a "
            "padded position's hidden state. Mask the prompt's labels (-100), as TRL's GRPO/RLOO do."
        )
    index = (column + lead[:, None]) % seq  # aligned position j holds the row's token j + lead
    moved = column >= seq - lead[:, None]  # the leading padding, now at the end
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = column + lead[:, None]
    elif position_ids.dim() != 2:
        raise NotImplementedError("left-padded rows under context parallelism take 2-D position_ids (or none)")
    else:
        position_ids = position_ids.gather(1, index)
        real = (~moved).sum(1)
        last = position_ids.gather(1, (real - 1).clamp(min=0)[:, None])
        position_ids = torch.where(moved, last + column - real[:, None] + 1, position_ids)
    kwargs["position_ids"] = position_ids
    kwargs["input_ids"] = kwargs["input_ids"].gather(1, index)
    kwargs["attention_mask"] = kwargs["attention_mask"].gather(1, index)
    kwargs["labels"] = labels.gather(1, index).masked_fill(moved, IGNORE_INDEX)
    return lead


def _restore_left_padding(field: torch.Tensor, lead: torch.Tensor) -> torch.Tensor:
    """[rows, seq - 1] per-token values of left-aligned rows -> the rows' own layout: position
    t of a row takes aligned position t - lead; the positions before (scored from padding:
    none, `_left_align` checks) are 0, as TRL's head leaves unlabelled positions."""
    column = torch.arange(field.shape[1], device=field.device)
    source = column - lead.to(field.device)[:, None]
    return field.gather(1, source.clamp(min=0)).masked_fill(source < 0, 0)


def _check_same_rows(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None, group: Any) -> None:
    """ValueError on every rank unless every rank of the cp group holds the same whole rows (one
    all-gather of a few integers: shapes and sums weighted by each token's place in the batch)."""
    rows, seq = input_ids.shape
    weights = torch.arange(1, rows * seq + 1, device=input_ids.device).view(rows, seq)  # row order counts too
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    summary = torch.stack([
        torch.tensor(rows, device=input_ids.device), torch.tensor(seq, device=input_ids.device),
        (input_ids.long() * weights).sum(), (labels.long() * weights).sum(), (mask.long() * weights).sum(),
    ])
    gathered = summary.new_empty(dist.get_world_size(group), summary.numel())
    all_gather_flat(gathered.view(-1), summary, group=group)  # the collectives' flat gather, as everywhere
    if not bool((gathered == gathered[0]).all()):
        raise ValueError(
            "a fused-head call with unshifted `labels` (TRL's whole-row form) under context parallelism needs the same "
            f"whole rows on every rank of the cp group; the ranks hold different batches (rows, length, sums: "
            f"{gathered.tolist()}). Pass the same batch on every cp rank (Accelerate's data loader does), or shard it "
            "yourself with qwen35_accel.context_parallel.shard_batch and pass `shift_labels`."
        )


def shard_whole_rows(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook (with kwargs) of a model carrying TRL's fused head: a call
    `model(input_ids=[rows, seq], attention_mask=…, labels=[rows, seq], fused_lm_head=True)` on a
    model under qwen35_accel's CP becomes this rank's part of the whole rows (`shard_batch`: labels
    shifted over the whole row into `shift_labels`, right-padded to a multiple of 2·cp, global
    `position_ids`), with a `WholeRows` record for the forward to gather the fields back. Any other
    call is left alone (None)."""
    from ...context_parallel import shard_batch
    from ...parallel.context_parallel.model import context_parallel_mesh

    if not kwargs.get("fused_lm_head") or kwargs.get("labels") is None or kwargs.get("shift_labels") is not None:
        return None
    cp_mesh = context_parallel_mesh(module)
    if cp_mesh is None:
        return None
    input_ids = kwargs.get("input_ids")
    if args or input_ids is None:
        raise NotImplementedError(
            "TRL's fused head on whole rows under context parallelism takes `input_ids` as a keyword (as TRL's "
            f"trainers pass it); got {len(args)} positional argument(s) and input_ids={'absent' if input_ids is None else 'given'}."
        )
    rows, seq = input_ids.shape
    unknown = [
        key for key, value in kwargs.items()
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, seq)
        and key not in _SEQUENCE_KEYS
    ]
    if unknown:
        multimodal = "mm_token_type_ids" in unknown or any(kwargs.get(k) is not None for k in ("pixel_values", "pixel_values_videos"))
        why = (
            " (TRL's vision-language collators pass them for rows with images or videos: image and video rows through "
            "TRL's preference trainers (DPO, KTO) under context parallelism are not supported; train them with cp_size 1, "
            "or pass text-only rows)." if multimodal else ". Drop them, or run with cp_size 1."
        )
        raise NotImplementedError(
            f"TRL's fused head on whole rows under context parallelism shards {', '.join(_SEQUENCE_KEYS)}; this call "
            f"also passes per-token {', '.join(unknown)}, which it would not shard{why}"
        )
    labels = kwargs["labels"]
    _check_same_rows(input_ids, labels, kwargs.get("attention_mask"), cp_mesh.get_group())
    label_mask = labels[:, 1:] != IGNORE_INDEX  # TRL's mask of the whole rows: next-token labels
    kwargs = dict(kwargs)
    lead = _left_align(kwargs, seq)  # GRPO/RLOO's left-padded prompts: the layout CP takes
    batch = shard_batch(kwargs, cp_mesh)  # `shift_labels` from the whole rows' labels
    del batch["labels"]  # TRL scores `shift_labels` as given
    batch[WHOLE_ROWS_KWARG] = WholeRows(cp_mesh=cp_mesh, seq=seq, label_mask=label_mask, lead=lead)
    return args, batch


def add_whole_rows_hook(model: nn.Module) -> None:
    """Put `shard_whole_rows` in front of `model`'s other forward pre-hooks (the CP model's input
    checks, registered at preparation, come after it; FSDP2 prepends its own when it wraps), once."""
    if getattr(model, _PRE_HOOK_ATTR, None) is None:
        setattr(model, _PRE_HOOK_ATTR, model.register_forward_pre_hook(shard_whole_rows, prepend=True, with_kwargs=True))


def gather_whole_rows(output: Any, whole: WholeRows, num_items_in_batch: Any) -> Any:
    """TRL's `FusedCausalLMOutput` of this rank's chunks -> the whole rows' (`[rows, seq - 1]` per
    field, as TRL returns for unshifted labels); the loss recomputed over the whole rows. One
    all-gather per dtype of the fields; its backward sends each rank its chunks' gradients."""
    from trl.trainer.utils import FusedCausalLMOutput

    from ...context_parallel import gather_sequence

    names = [name for name in _PER_TOKEN if getattr(output, name, None) is not None]
    dtype = output.log_probs.dtype
    fields: dict[str, torch.Tensor | None] = dict.fromkeys(_PER_TOKEN)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in names:
        by_dtype.setdefault(dtype if name == "is_top1" else getattr(output, name).dtype, []).append(name)
    for group_dtype, group in by_dtype.items():
        stacked = torch.stack([getattr(output, name).to(group_dtype) for name in group])  # [fields, rows, local]
        gathered = gather_sequence(stacked.contiguous(), whole.cp_mesh, seq_dim=2)[..., : whole.seq - 1]
        if whole.lead is not None:
            gathered = torch.stack([_restore_left_padding(value, whole.lead) for value in gathered.unbind(0)])
        for name, value in zip(group, gathered.unbind(0)):
            fields[name] = value.bool() if name == "is_top1" else value
    mask = whole.label_mask.to(fields["log_probs"].device)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if getattr(output, "aux_loss", None) is not None:
        raise NotImplementedError("TRL's MoE auxiliary loss under context parallelism (dense Qwen3.5 has none)")
    return FusedCausalLMOutput(loss=-fields["log_probs"].sum() / count, label_mask=mask, **fields)


def _ranks_at_zero(mesh: DeviceMesh, dims: tuple[str, ...]) -> list[int]:
    """The global ranks whose coordinates along `dims` (those the mesh has) are 0, ascending."""
    names = list(mesh.mesh_dim_names or ())
    at_zero = tuple(0 if name in dims else slice(None) for name in names)
    return sorted(mesh.mesh[at_zero].flatten().tolist())


@contextlib.contextmanager
def counted_once_per_cp_group(accelerator: Any, dims: tuple[str, ...] = ("cp",)) -> Iterator[None]:
    """For the duration: `accelerator.gather` (and so `gather_for_metrics`, which calls it) keeps
    the parts of the ranks at cp coordinate 0 only. Every rank of a cp group holds the same whole
    rows in these trainers, so stock gathering returns each row cp times (TRL's `num_tokens` cp
    times larger, its precomputed reference log-probs duplicated and misplaced); what is kept is
    what the ranks without cp would gather. `dims`: the mesh dims whose ranks hold the same rows
    and are counted once ("cp", and "tp" where TRL does not divide by tp itself). The same
    collective as stock; nothing changes without those dims in the accelerator's mesh, or when
    already inside."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None or all(mesh_dim_size(mesh, d) == 1 for d in dims) or "gather" in vars(accelerator):
        yield
        return
    from accelerate.utils import recursively_apply

    keep = torch.tensor(_ranks_at_zero(mesh, dims))
    world = mesh.size()
    stock = accelerator.gather

    def once(tensor: torch.Tensor) -> torch.Tensor:  # [world * n, ...] in rank order -> the kept ranks' parts
        return tensor.view(world, -1, *tensor.shape[1:])[keep.to(tensor.device)].flatten(0, 1)

    @functools.wraps(stock)
    def gather(tensor: Any) -> Any:
        return recursively_apply(once, stock(tensor))

    accelerator.gather = gather
    try:
        yield
    finally:
        del accelerator.gather


def _applies(trainer: Any) -> bool:
    from ..targets import is_dense_qwen35_module

    model = getattr(trainer, "model", None)
    return model is not None and is_dense_qwen35_module(model)


def trl_counted_once(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of a whole-row trainer's method (`compute_loss`, `_precompute_ref_logps`) for a
    dense Qwen3.5 model: run inside `counted_once_per_cp_group` (a no-op without cp). The
    reference precompute counts tp ranks once too: tp ranks hold the same rows and TRL gathers
    their log-probs over all processes (stock: each row tp times, misplaced), while its loss
    divides its token count by tp itself."""
    dims = ("cp", "tp") if original.__name__ == "_precompute_ref_logps" else ("cp",)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _applies(self):
            return original(self, *args, **kwargs)
        with counted_once_per_cp_group(self.accelerator, dims):
            return original(self, *args, **kwargs)

    return wrapper
