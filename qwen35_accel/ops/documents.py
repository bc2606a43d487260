"""Run a per-sequence op on every document of packed rows, each as if it were alone.

Documents are grouped by their length rounded up to `multiple` (the gated delta rule's
chunk size: the kernel pads to it anyway), each group padded at the end into one batch,
the op run once per group, and the outputs scattered back. For causal ops (the causal
conv, the gated delta rule from a zero state) the padding after a document changes none
of its outputs, so each document's output is exactly the op on that document alone, and
the padded work stays within one `multiple` per document.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class DocumentGroup:
    """Documents of one padded length P: `members` [n] long (document numbers), `index`
    [n, P] long (token of each slot; 0 where not `valid`), `valid` [n, P] bool; `slots`
    [tokens of the group] long (the valid slots of the flattened [n * P]) and `tokens` (their
    tokens), made with the group so that scattering back needs no boolean-mask index (a host
    sync on CUDA) in every layer."""

    members: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor
    slots: torch.Tensor
    tokens: torch.Tensor

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] -> [n, P, ...], zeros after each document."""
        return torch.where(self.valid.view(*self.valid.shape, *([1] * (x.dim() - 1))), x[self.index], 0)


# Groups per `cu_seq_lens` tensor object: the packing hooks make them before the first layer
# (`document_groups` there), so no layer's forward or backward waits on the host; they hand every layer of a forward
# (and its recomputation) the same tensor, so the groups, whose sizes need one host sync,
# are made once per forward instead of twice per GatedDeltaNet layer.
# Keyed by id (tensors compare elementwise, so they cannot be dict keys by value); an
# entry dies with its tensor.
_GROUPS: dict[int, tuple[weakref.ref[torch.Tensor], dict[int, list[DocumentGroup]]]] = {}


def document_groups(cu_seq_lens: torch.Tensor, multiple: int = 64) -> list[DocumentGroup]:
    """The documents of `cu_seq_lens` [documents + 1] (offsets in the flattened tokens),
    grouped by their length rounded up to `multiple`. Cached per tensor object (do not
    modify a `cu_seq_lens` in place after passing it)."""
    entry = _GROUPS.get(id(cu_seq_lens))
    if entry is None or entry[0]() is not cu_seq_lens:
        entry = (weakref.ref(cu_seq_lens), {})
        _GROUPS[id(cu_seq_lens)] = entry
        weakref.finalize(cu_seq_lens, _GROUPS.pop, id(cu_seq_lens), None)
    cached = entry[1]
    if multiple not in cached:
        cached[multiple] = _groups(cu_seq_lens, multiple)
    return cached[multiple]


def _groups(cu_seq_lens: torch.Tensor, multiple: int) -> list[DocumentGroup]:
    # On the host, from one copy of the offsets (a single device-to-host read for a device tensor;
    # none for one that lives on the host): the group sizes decide shapes, which the host needs anyway.
    cu = cu_seq_lens.detach().to("cpu", torch.long)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    padded = (lengths + multiple - 1) // multiple * multiple
    groups = []
    for size in torch.unique(padded).tolist():
        members = torch.nonzero(padded == size).flatten()
        offsets = torch.arange(size)
        valid = offsets[None, :] < lengths[members, None]
        index = torch.where(valid, starts[members, None] + offsets[None, :], 0)
        slots = valid.flatten().nonzero().flatten()
        parts = (members, index, valid, slots, index.flatten()[slots])
        groups.append(DocumentGroup(*(t.to(cu_seq_lens.device, non_blocking=True) for t in parts)))
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
    return per_document_with_state(lambda *x: (fn(*x), None), inputs, cu_seq_lens, multiple=multiple)[0]


def per_document_with_state(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    inputs: Sequence[torch.Tensor],
    cu_seq_lens: torch.Tensor,
    *,
    multiple: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `per_document`, for an `fn` that also returns one tensor per document.

    `fn(*padded)` returns (per token [n, P, ...], per document [n, ...] or None); returns
    (per token [tokens, ...], per document [documents, ...] in document order, or None).
    For a causal op the per-document result must not depend on the zeros after the
    document (a final recurrent state: the padding's zero beta and zero log-decay leave it unchanged).
    """
    tokens = inputs[0].shape[0]
    documents = cu_seq_lens.numel() - 1
    out: torch.Tensor | None = None
    states: torch.Tensor | None = None
    for group in document_groups(cu_seq_lens, multiple):
        result, state = fn(*(group.gather(x) for x in inputs))
        if out is None:
            out = result.new_zeros(tokens, *result.shape[2:])
        # In place: autograd's index_copy_ backward needs neither `out` nor a copy of it per group.
        out.index_copy_(0, group.tokens, result.flatten(0, 1).index_select(0, group.slots))
        if state is not None:
            if states is None:
                states = state.new_zeros(documents, *state.shape[1:])
            states.index_copy_(0, group.members, state)
    assert out is not None, "cu_seq_lens holds no document"
    return out, states
