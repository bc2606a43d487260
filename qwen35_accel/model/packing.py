"""Packed rows: several documents in one row, each computed as if it were alone.

Collators produce packed (padding-free) rows in three forms: `position_ids` restarting
inside a row (Transformers' `DataCollatorWithFlattening`, TRL's padding-free mode),
`cu_seq_lens_q`/`cu_seq_lens_k` with `max_length_q`/`max_length_k` (flash-attention
kwargs), and `seq_idx` (a document index per token). `document_layout` turns whichever
were given into one `DocumentLayout`, checking that they agree.

Transformers' GatedDeltaNet fallbacks ignore document boundaries, and its attention
honours them only when no cache exists, while a Trainer's forward runs with the config's
`use_cache=True`. `install_packing_hook` therefore puts a forward pre-hook on the text
model: for a packed row it refuses a cache the caller passed (generation with packed rows
is meaningless), turns `use_cache` off (so attention builds its per-document mask from
`position_ids`), completes `position_ids` from `cu_seq_lens_q` when only those were given,
and hands the layout to the layers as the `cu_seq_lens_q`/`max_length_q` kwargs that
Transformers propagates to every decoder layer. The GatedDeltaNet layers of this package
read them: the causal conv does not look across a document start, and the recurrence
starts each document from a zero state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from ..ops.documents import document_groups

# Set (True) on a text model whose layers see a sequence sharded across ranks (context
# parallelism): its rows are not packed rows, and its own checks apply.
SEQUENCE_SHARDED_ATTR = "_qwen35_sequence_sharded"
_HOOKED_ATTR = "_qwen35_packing_hook"


@dataclasses.dataclass(frozen=True)
class DocumentLayout:
    """Documents of a packed batch, flattened row after row.

    `cu_seq_lens` [documents + 1] int32: offsets of each document in the flattened
    `[batch * seq]` tokens (0 first, batch * seq last); `max_length`: the longest document.
    """

    cu_seq_lens: torch.Tensor
    max_length: int

    def position_ids(self, batch: int, seq_len: int) -> torch.Tensor:
        """[batch, seq_len] long: 0, 1, … within each document."""
        index = torch.arange(batch * seq_len, device=self.cu_seq_lens.device)
        starts = self.cu_seq_lens[:-1].long()
        first = starts[torch.searchsorted(starts, index, right=True) - 1]
        return (index - first).view(batch, seq_len)

    def starts(self, batch: int, seq_len: int) -> torch.Tensor:
        """[batch, seq_len] bool: True at each document's first token."""
        flags = torch.zeros(batch * seq_len, dtype=torch.bool, device=self.cu_seq_lens.device)
        flags[self.cu_seq_lens[:-1].long()] = True
        return flags.view(batch, seq_len)


def layout_from_starts(starts: torch.Tensor) -> DocumentLayout:
    """`starts` [batch, seq] bool (every row's first token a start) -> the layout (its
    `cu_seq_lens` on `starts`' device), from one host copy of `starts`: one device-to-host read."""
    flat = starts.reshape(-1).cpu()
    offsets = torch.nonzero(flat).flatten().to(torch.int32)
    cu = torch.cat([offsets, offsets.new_tensor([flat.numel()])])
    return DocumentLayout(cu.to(starts.device, non_blocking=True), int((cu[1:] - cu[:-1]).max()))


def text_positions(position_ids: torch.Tensor, batch: int) -> torch.Tensor | None:
    """[batch, seq] text positions, as Qwen3.5's text model reads them: 2-D ids, or row 0
    of [4, batch, seq] ids; [3, batch, seq] ids are multimodal rotary positions only
    (image tokens share positions), which say nothing about documents: None."""
    if position_ids.dim() == 3:
        if position_ids.shape[0] != 4:
            return None
        position_ids = position_ids[0]
    return position_ids.expand(batch, -1)


def starts_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] bool: a document starts where a position is not its predecessor + 1
    (the rule Transformers' attention masks use), and at every row's first token."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def document_layout(
    batch: int,
    seq_len: int,
    *,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> DocumentLayout | None:
    """The documents of a `[batch, seq_len]` batch, or None when every row is one document.

    Every form given must describe the same boundaries (ValueError naming both otherwise);
    `cu_seq_lens_q` must run from 0 to `batch * seq_len` in increasing steps.
    """
    layouts: dict[str, torch.Tensor] = {}
    text = text_positions(position_ids, batch) if position_ids is not None else None
    if text is not None:
        layouts["position_ids"] = starts_from_position_ids(text)
    for name, cu in (("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k)):
        if cu is None:
            continue
        cu = cu.flatten().long()
        total = batch * seq_len
        if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
            raise ValueError(
                f"{name} must start at 0 and end at the number of tokens in the batch ({batch} x {seq_len} = {total}); "
                f"got {cu.tolist()[:8]}{' …' if cu.numel() > 8 else ''} ending at {int(cu[-1])}"
            )
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError(f"{name} must increase strictly (one offset per document start); got {cu.tolist()[:16]}")
        flags = torch.zeros(total, dtype=torch.bool, device=cu.device)
        flags[cu[:-1]] = True
        flags = flags.view(batch, seq_len)
        if not bool(flags[:, 0].all()):
            raise ValueError(f"{name} puts a document across rows of the batch; every row must start a document")
        layouts[name] = flags
    if seq_idx is not None:
        index = seq_idx.view(batch, seq_len)
        flags = torch.ones_like(index, dtype=torch.bool)
        flags[:, 1:] = index[:, 1:] != index[:, :-1]
        layouts["seq_idx"] = flags
    if not layouts:
        return None
    names = list(layouts)
    reference = layouts[names[0]]
    for name in names[1:]:
        if reference.shape != layouts[name].shape or not torch.equal(reference.cpu(), layouts[name].cpu()):
            raise ValueError(
                f"{names[0]} and {name} describe different document boundaries (first at token "
                f"{_first_difference(reference, layouts[name])}); pass one form, or make them agree"
            )
    if not bool(reference[:, 1:].any()):
        return None
    return layout_from_starts(reference)


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape:
        return 0
    return int(torch.nonzero((a != b).reshape(-1))[0])


def _one_document_per_padded_row(position_ids: torch.Tensor | None, attention_mask: Any, batch: int) -> bool:
    """Whether a padded batch's `position_ids` restart only at padded tokens: left-padded
    prompts in generation get positions like [1, 1, 0, 1, 2] (Transformers numbers the real
    tokens from 0 and fills the padding with 1), which the position rule alone would read as
    several documents. True when, among the real tokens, only each row's first one starts a
    document: one sequence per row, which the stock model handles with the mask."""
    if position_ids is None or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return False
    real = attention_mask.bool()
    if bool(real.all()):
        return False
    text = text_positions(position_ids, batch)
    if text is None or text.shape != real.shape:
        return False
    before = real.long().cumsum(1) - real.long()  # real tokens before each position
    # Each real token but a row's first continues the previous real token's position.
    previous = torch.where(real, text, torch.zeros_like(text)).cummax(1).values  # positions increase within a sequence
    expected = torch.cat([previous[:, :1], previous[:, :-1]], dim=1) + 1
    continues = (text == expected) | (before == 0)
    return bool((continues | ~real).all())


def refuse_packed_rows_of_a_sequence_classifier(how: str) -> None:
    """Raise for packed rows (`how` names the form seen) given to a sequence classifier."""
    raise ValueError(
        f"packed rows (several documents per row: {how}) given to a sequence classifier (reward model): it scores "
        "each row from its last real token, so a packed row would get one score, from its last document alone, "
        "against the row's one label. Pad the rows instead, one sample per row (the Trainer's default collator and "
        "TRL's RewardTrainer do)."
    )


def _packing_pre_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, one_score_per_row: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if module.__dict__.get(SEQUENCE_SHARDED_ATTR):
        return args, kwargs
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None and args:
        tokens = args[0]
    if tokens is None:
        return args, kwargs
    batch, seq_len = tokens.shape[:2]
    layout = document_layout(
        batch,
        seq_len,
        position_ids=kwargs.get("position_ids"),
        cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
        cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
        seq_idx=kwargs.get("seq_idx"),
    )
    if layout is None or _one_document_per_padded_row(kwargs.get("position_ids"), kwargs.get("attention_mask"), batch):
        return args, kwargs
    if one_score_per_row:
        refuse_packed_rows_of_a_sequence_classifier("position_ids restarting inside a row, cu_seq_lens_q or seq_idx")
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise NotImplementedError(
            "packed rows (several documents per row) cannot be combined with a cache (generation): a cache holds one "
            "sequence per row. Generate from unpacked rows."
        )
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None:
        if attention_mask.dim() != 2 or not bool(attention_mask.bool().all()):
            raise ValueError(
                "packed rows (position_ids restarting inside a row, cu_seq_lens_q or seq_idx) cannot be combined with "
                "padding in attention_mask: pack without padding (padding-free collators pass no attention_mask)"
            )
        kwargs["attention_mask"] = None  # all ones; attention builds the per-document mask from position_ids
    kwargs["use_cache"] = False
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = layout.position_ids(batch, seq_len)
    kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = layout.cu_seq_lens
    kwargs["max_length_q"] = kwargs["max_length_k"] = layout.max_length
    kwargs.pop("seq_idx", None)
    document_groups(layout.cu_seq_lens)  # here, once: the GatedDeltaNet layers then wait on no host sync
    return args, kwargs


def install_packing_hook(text_model: nn.Module, *, one_score_per_row: bool = False) -> bool:
    """Make `text_model` (a `Qwen3_5TextModel`) compute packed rows document by document; with
    `one_score_per_row` (the backbone of a sequence classifier) refuse them instead
    (`refuse_packed_rows_of_a_sequence_classifier`).

    Idempotent; returns whether the hook was added by this call.
    """
    if text_model.__dict__.get(_HOOKED_ATTR):
        return False
    hook = functools.partial(_packing_pre_hook, one_score_per_row=True) if one_score_per_row else _packing_pre_hook
    text_model.register_forward_pre_hook(hook, with_kwargs=True)
    text_model.__dict__[_HOOKED_ATTR] = True
    return True
