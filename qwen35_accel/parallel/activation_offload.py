"""Activation offload: the inputs a checkpointed layer keeps for its recompute, in host memory.

With activation checkpointing a decoder layer keeps only its inputs between forward and backward
(per rank: its CP chunk of `[batch, seq, hidden]`, its TP share), which at long context is the
activation memory that remains (`layers × local tokens × hidden` bytes). `ActivationOffload` moves
them to pinned host memory when the forward saves them and back when the recompute needs them.
It is the saved-tensors hooks around each checkpointed layer's call, entered before the
checkpoint's own (which keeps nothing of the layer's inside), so only the inputs the checkpoint
saves pass through it: what Accelerate's `fsdp_activation_checkpointing_offload` and
Transformers' `gradient_checkpointing_kwargs={"offload": True}` ask for.

Copies are `non_blocking` on the current stream in both directions: no host synchronisation, and
stream order keeps them correct (the device memory a saved input leaves is reused only by work
queued after its copy; the copy back precedes the recompute that reads it; torch's pinned-memory
allocator keeps a buffer until the copies using it are done). Tensors already on the host (CPU
runs) stay where they are: the same code runs, nothing moves, results are exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint

ACTIVATION_OFFLOAD_ATTR = "_qwen35_activation_offload"  # on the model: its `ActivationOffload`


@dataclasses.dataclass
class OffloadStats:
    """What went through the hooks since the last `reset()`: saved tensors and their bytes,
    and how many of those were moved to host memory (0 on CPU runs)."""

    tensors: int = 0
    bytes: int = 0
    moved_tensors: int = 0
    moved_bytes: int = 0


class ActivationOffload:
    """Saved-tensors hooks that keep a checkpointed layer's saved inputs in host memory.

    `attach(layer)` after `checkpoint(layer)`: a forward pre-hook enters the hooks (before the
    checkpoint's pre-hook, which saves the layer's inputs), a forward hook leaves them (after the
    checkpoint's). Training forwards only (grad enabled); never during the recompute.
    """

    def __init__(self, pin_memory: bool = True, always_copy: bool = False) -> None:
        self.pin_memory = pin_memory
        self.always_copy = always_copy  # tests: copy host tensors too, so the copy path runs on CPU
        self.stats = OffloadStats()
        self._entered: dict[int, list[Any]] = {}

    def reset(self) -> None:
        self.stats = OffloadStats()

    def pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        if tensor.device.type == "meta" or (tensor.device.type == "cpu" and not self.always_copy):
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                           pin_memory=self.pin_memory and torch.cuda.is_available())
        host.copy_(tensor, non_blocking=True)
        self.stats.moved_tensors += 1
        self.stats.moved_bytes += nbytes
        return tensor.device, host

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    def attach(self, layer: nn.Module) -> None:
        """Offload what `checkpoint(layer)` saves (call after `checkpoint(layer)`)."""
        # Forward pre-hooks run in registration order and the checkpoint registered its own already:
        # prepend ours so that its input save happens inside our hooks.
        layer.register_forward_pre_hook(self._enter, prepend=True)
        layer.register_forward_hook(self._leave, always_call=True)  # after the checkpoint's (prepended)

    def _enter(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        if not (torch.is_grad_enabled() and checkpoint.state(layer).enable_hook):
            return  # no autograd graph, or the checkpoint's recompute: nothing to keep
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._entered.setdefault(id(layer), []).append(hooks)

    def _leave(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        stack = self._entered.get(id(layer))
        if stack:
            stack.pop().__exit__(None, None, None)
