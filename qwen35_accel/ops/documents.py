"""Run a per-sequence op on every document of packed rows, each as if it were alone.

Documents are grouped by their length rounded up to `multiple` (the gated delta rule's
chunk size: the kernel pads to it anyway), each group padded at the end into one batch,
the op run once per group, and the outputs scattered back. For causal ops (the causal
conv, the gated delta rule from a zero state) the padding after a document changes none
of its outputs, so each document's output is exactly the op on that document alone, and
the padded work stays within one `multiple` per document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def document_groups(cu_seq_lens: torch.Tensor, multiple: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token index [n, P] long, valid [n, P] bool) per group of documents padded to P.

    `cu_seq_lens` [documents + 1]: document offsets in the flattened tokens. P is a
    multiple of `multiple`; index entries where `valid` is False point at token 0.
    """
    cu = cu_seq_lens.long()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    padded = (lengths + multiple - 1) // multiple * multiple
    groups = []
    for size in torch.unique(padded).tolist():
        members = torch.nonzero(padded == size).flatten()
        offsets = torch.arange(size, device=cu.device)
        valid = offsets[None, :] < lengths[members, None]
        index = torch.where(valid, starts[members, None] + offsets[None, :], 0)
        groups.append((index, valid))
    return groups


def per_document(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    cu_seq_lens: torch.Tensor,
    *,
    multiple: int = 64,
) -> torch.Tensor:
    """`fn` on every document of flattened `inputs`, the outputs in token order.

    `inputs`: tensors of shape [tokens, ...] (the same tokens, any trailing shapes);
    `fn(*padded)` takes them as [n, P, ...] (n documents padded to P, zeros after each)
    and returns [n, P, ...]. Returns [tokens, ...] in `fn`'s output dtype. Differentiable.
    """
    tokens = inputs[0].shape[0]
    out: torch.Tensor | None = None
    for index, valid in document_groups(cu_seq_lens, multiple):
        padded = [torch.where(valid.view(*valid.shape, *([1] * (x.dim() - 1))), x[index], 0) for x in inputs]
        result = fn(*padded)
        if out is None:
            out = result.new_zeros(tokens, *result.shape[2:])
        out = out.index_copy(0, index[valid], result[valid])
    assert out is not None, "cu_seq_lens holds no document"
    return out
