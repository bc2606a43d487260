"""Activation offload: the inputs a checkpointed layer keeps for its recompute, in host memory.

With activation checkpointing a decoder layer keeps only its inputs between forward and backward
(per rank: its CP chunk of `[batch, seq, hidden]`, its TP share), which at long context is the
activation memory that remains (`layers × local tokens × hidden` bytes). `ActivationOffload` moves
them to pinned host memory when the forward saves them and back when the recompute needs them.
It is the saved-tensors hooks around each checkpointed layer's call, entered before the
checkpoint's own (which keeps nothing of the layer's inside), so only the inputs the checkpoint
saves pass through it: what Accelerate's `fsdp_activation_checkpointing_offload` and
Transformers' `gradient_checkpointing_kwargs={"offload": True}` ask for.

On a device with streams (CUDA, XPU: `torch.get_device_module(device).Stream`) the copies run on
one side stream per device, so they overlap the layers' compute and the host never waits:
- to the host: the side stream waits on an event recorded on the current stream (the saved
  input is complete), copies into a pinned buffer, and the input is `record_stream`ed on the side
  stream, so the allocator does not hand its memory out again before the copy has read it. When
  the layer's forward ends, the current stream waits on the layer's copies: a later kernel that
  writes a saved input in place (autograd's version check is off for tensors that saved-tensor
  hooks pack) cannot run before the copy has read it; the copies overlap the layer's own compute;
- back: the saved inputs of one layer call form a group, linked to the call before it in the same
  forward (a weak reference: a group lives exactly as long as autograd holds its saved tensors).
  When backward unpacks layer i's group (its recompute starts), layer i-1's group is copied back on
  the side stream (prefetched), overlapping layer i's recompute and backward; unpacking a
  prefetched tensor makes the current stream wait on its copy's event and records the tensor on
  the current stream (allocated on the side stream, it is used and freed on the current one). The
  group drops each prefetched tensor as it hands it over. The last layer's group (the first that
  backward unpacks), a group unpacked again or out of order, is copied back on the current stream
  after its copy to the host (waited on by event): correct in any order.
- A tensor object saved by several layer calls of one forward, as a positional input, is copied
  to the host once: matched by identity (a weak reference to it, so a reused `id` never matches)
  and by `_version` (not modified in place since). Transformers' Qwen3.5 decoder layers take their
  rotary cos/sin by keyword, which the checkpoint keeps in its recompute closure, not through
  these hooks: for them nothing is deduplicated (each layer's hidden states are its own).
The stream operations go through one object (`DeviceStreams`; `ActivationOffload(streams=…)`), so
a CPU test can stand a stream whose copies run only when waited on in for the device's, and see
the ordering. On CPU (`always_copy`: tests and benchmarks) and on devices without streams the same
bookkeeping runs with plain copies on the current stream. Tensors already on the host (CPU runs) otherwise
stay where they are: the same code runs, nothing moves, results are exact. The side-stream path
needs a GPU: the tests here run the CPU path (the same groups, prefetch order and dedupe).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint


@dataclasses.dataclass
class OffloadStats:
    """What went through the hooks since the last `reset()`: saved tensors and their bytes; of
    those, how many were copied to host memory (0 on CPU runs without `always_copy`) and how many
    reused the host copy of the same tensor saved by an earlier layer call (`deduplicated_*`); in
    backward, how many were copied back ahead of their layer's recompute (`prefetched_*`) and how
    many when unpacked (`unprefetched_tensors`: the first group backward unpacks, a second unpack).
    `order`: with `ActivationOffload(record_order=True)`, ("unpack" | "prefetch", the layer call's
    index in its forward) as backward did them; None otherwise."""

    tensors: int = 0
    bytes: int = 0
    moved_tensors: int = 0
    moved_bytes: int = 0
    deduplicated_tensors: int = 0
    deduplicated_bytes: int = 0
    prefetched_tensors: int = 0
    prefetched_bytes: int = 0
    unprefetched_tensors: int = 0
    order: list[tuple[str, int]] | None = None


class DeviceStreams:
    """The stream operations of `ActivationOffload` on a device's own streams (CUDA, XPU): one side
    stream per device (None for the host, meta and devices without streams), the current stream,
    copies issued on a stream with an event after them, and `record_stream`."""

    def __init__(self) -> None:
        self._side: dict[torch.device, Any] = {}

    def side(self, device: torch.device) -> Any:
        if device.type in ("cpu", "meta"):
            return None
        if device not in self._side:
            module = torch.get_device_module(device)
            self._side[device] = module.Stream(device=device) if hasattr(module, "Stream") else None
        return self._side[device]

    def current(self, device: torch.device) -> Any:
        return torch.get_device_module(device).current_stream(device)

    def copy_into(self, stream: Any, destination: torch.Tensor, source: torch.Tensor) -> Any:
        """`destination.copy_(source)` issued on `stream`; returns the event recorded after it."""
        with torch.get_device_module(source.device).stream(stream):
            destination.copy_(source, non_blocking=True)
            return stream.record_event()

    def copy_to_device(self, stream: Any, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """`host` copied to `device` on `stream`: (the new tensor, the event after the copy)."""
        with torch.get_device_module(device).stream(stream):
            return host.to(device, non_blocking=True), stream.record_event()

    def keep_until_done(self, tensor: torch.Tensor, stream: Any) -> None:
        """The allocator keeps `tensor`'s memory until the work queued on `stream` so far is done."""
        tensor.record_stream(stream)


class _HostCopy:
    """One saved tensor in host memory: `host`, the `device` it returns to, and `copied`, the side
    stream's event after the copy (None: a copy on the current stream, ordered by it)."""

    __slots__ = ("host", "device", "copied", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied: Any) -> None:
        self.host, self.device, self.copied = host, device, copied


class _LayerCall:
    """The saved inputs of one checkpointed layer's call (`copies`, in the order the forward
    saved them), the call before it in the same forward (`previous`, a weak reference) and what
    backward copied back ahead of the recompute (`prefetched`: position -> (tensor, event))."""

    __slots__ = ("index", "previous", "copies", "prefetched", "unpacked", "__weakref__")

    def __init__(self, index: int, previous: _LayerCall | None) -> None:
        self.index = index
        self.previous = weakref.ref(previous) if previous is not None else None
        self.copies: list[_HostCopy] = []
        self.prefetched: dict[int, tuple[torch.Tensor, Any]] = {}
        self.unpacked = False


class ActivationOffload:
    """Saved-tensors hooks that keep a checkpointed layer's saved inputs in host memory.

    `attach(layer)` after `checkpoint(layer)`: a forward pre-hook enters the hooks (before the
    checkpoint's pre-hook, which saves the layer's inputs), a forward hook leaves them (after the
    checkpoint's). Training forwards only (grad enabled); never during the recompute. A forward is
    the layer calls until a layer is called again (which starts the next forward's chain).
    """

    def __init__(self, pin_memory: bool = True, always_copy: bool = False, record_order: bool = False,
                 streams: DeviceStreams | None = None) -> None:
        self.pin_memory = pin_memory
        self.always_copy = always_copy  # tests: copy host tensors too, so the copy path runs on CPU
        self.record_order = record_order  # tests: `stats.order`
        self.streams = streams or DeviceStreams()
        self.reset()
        self._entered: dict[int, list[tuple[Any, _LayerCall]]] = {}
        self._chain: set[int] = set()  # the layers called so far in this forward
        self._last: weakref.ref | None = None  # this forward's latest layer call (autograd keeps it alive, not we)
        # id(tensor) -> (weak reference to it, its _version, weak reference to its host copy): this forward's copies
        self._copies: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}

    def reset(self) -> None:
        self.stats = OffloadStats(order=[] if self.record_order else None)

    def attach(self, layer: nn.Module) -> None:
        """Offload what `checkpoint(layer)` saves (call after `checkpoint(layer)`)."""
        # Forward pre-hooks run in registration order and the checkpoint registered its own already:
        # prepend ours so that its input save happens inside our hooks.
        layer.register_forward_pre_hook(self._enter, prepend=True)
        layer.register_forward_hook(self._leave, always_call=True)  # after the checkpoint's (prepended)

    def _enter(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        if not (torch.is_grad_enabled() and checkpoint.state(layer).enable_hook):
            return  # no autograd graph, or the checkpoint's recompute: nothing to keep
        if id(layer) in self._chain:  # called again: a new forward, linked to nothing of the last
            self._chain.clear()
            self._last = None
            self._copies.clear()
        self._chain.add(id(layer))
        # Host copies of tensors gone (or whose groups are gone) can match nothing any more.
        self._copies = {key: entry for key, entry in self._copies.items() if entry[0]() is not None and entry[2]() is not None}
        call = _LayerCall(len(self._chain) - 1, self._last() if self._last is not None else None)
        self._last = weakref.ref(call)
        hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self.pack, call), self.unpack)
        hooks.__enter__()
        self._entered.setdefault(id(layer), []).append((hooks, call))

    def _leave(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        stack = self._entered.get(id(layer))
        if stack:
            hooks, call = stack.pop()
            hooks.__exit__(None, None, None)
            # What runs after this layer may write its saved inputs in place: not before their copies.
            for copy in call.copies:
                if copy.copied is not None:
                    self.streams.current(copy.device).wait_event(copy.copied)

    def pack(self, call: _LayerCall, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        if tensor.device.type == "meta" or (tensor.device.type == "cpu" and not self.always_copy):
            return tensor
        call.copies.append(self._host_copy(tensor, nbytes))
        return call, len(call.copies) - 1

    def _host_copy(self, tensor: torch.Tensor, nbytes: int) -> _HostCopy:
        """`tensor`'s host copy: the one an earlier layer call of this forward made of the same
        tensor, unchanged since, or a new one."""
        known = self._copies.get(id(tensor))
        if known is not None:
            source, version, copy = known[0](), known[1], known[2]()
            if source is tensor and tensor._version == version and copy is not None:
                self.stats.deduplicated_tensors += 1
                self.stats.deduplicated_bytes += nbytes
                return copy
        copy = self._copy_out(tensor)
        self._copies[id(tensor)] = (weakref.ref(tensor), tensor._version, weakref.ref(copy))
        self.stats.moved_tensors += 1
        self.stats.moved_bytes += nbytes
        return copy

    def _copy_out(self, tensor: torch.Tensor) -> _HostCopy:
        device = tensor.device
        stream = self.streams.side(device)
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                           pin_memory=self.pin_memory and stream is not None)
        if stream is None:  # the host, or a device without streams: on the current stream, in its order
            host.copy_(tensor, non_blocking=device.type != "cpu")
            return _HostCopy(host, device, None)
        stream.wait_event(self.streams.current(device).record_event())  # the saved input is complete
        copied = self.streams.copy_into(stream, host, tensor)
        self.streams.keep_until_done(tensor, stream)  # its memory is not reused before the copy has read it
        return _HostCopy(host, device, copied)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        call, position = packed
        if not call.unpacked:  # the recompute of this layer starts: fetch the layer before it meanwhile
            call.unpacked = True
            self._record("unpack", call.index)
            previous = call.previous() if call.previous is not None else None
            if previous is not None and not previous.unpacked and not previous.prefetched:
                self._prefetch(previous)
        fetched = call.prefetched.pop(position, None)  # handed over once: the group keeps no device copy
        if fetched is None:
            self.stats.unprefetched_tensors += 1
            return self._copy_back(call.copies[position])
        tensor, ready = fetched
        if ready is not None:
            current = self.streams.current(tensor.device)
            current.wait_event(ready)
            self.streams.keep_until_done(tensor, current)  # allocated on the side stream, used and freed on this one
        return tensor

    def _prefetch(self, call: _LayerCall) -> None:
        """Copy `call`'s saved inputs back on the side stream (each with its event)."""
        self._record("prefetch", call.index)
        for position, copy in enumerate(call.copies):
            stream = self.streams.side(copy.device)
            if stream is None:
                call.prefetched[position] = (self._copy_back(copy), None)
            else:  # after the copy out: the same stream
                call.prefetched[position] = self.streams.copy_to_device(stream, copy.host, copy.device)
            self.stats.prefetched_tensors += 1
            self.stats.prefetched_bytes += copy.host.numel() * copy.host.element_size()

    def _copy_back(self, copy: _HostCopy) -> torch.Tensor:
        """`copy` back to its device on the current stream, after its copy to the host."""
        if copy.copied is not None:
            self.streams.current(copy.device).wait_event(copy.copied)
        return copy.host.to(copy.device, non_blocking=copy.device.type != "cpu", copy=True)

    def _record(self, what: str, index: int) -> None:
        if self.stats.order is not None:
            self.stats.order.append((what, index))
