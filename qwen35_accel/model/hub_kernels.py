"""Transformers' Hub kernels (`kernelize`) on a model whose layers qwen35_accel takes over.

From Transformers 5.25 (with the `kernels` package, one of its requirements) `from_pretrained`
kernelizes the model by default, and `PreTrainedModel.train()`/`eval()` kernelize it again
whenever the mode changes. Kernelizing gives every module of a class Transformers marks for
the Hub (`kernel_layer_name`: Qwen3.5's GatedDeltaNet, its gated RMSNorm, its RMSNorm) an
instance-level `forward`: a Hub kernel's where one fits the device, else its own class's
`forward` of that moment. An instance attribute outlives a class swap, so a GatedDeltaNet
turned into qwen35_accel's fp32-gate, CP or TP layer would go on running Transformers' forward
(under CP each rank's chunks without the state passed between ranks: silently wrong) or a Hub
kernel's, until the next change of mode happened to rebind it.

So before any surgery, Transformers' kernelization of the model is turned off (its own switch,
`use_kernels = False`, which also keeps `train()` from kernelizing again), and every class swap
goes through `swap_class`, which drops an instance-level `forward` that would shadow the new
class's.
"""

from __future__ import annotations

import types

from torch import nn



def _kernelize_forward(module: nn.Module) -> types.MethodType | None:
    """The instance-level `forward` kernelize set on `module` (a method bound to it), or None."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        return forward
    return None


def turn_off_hub_kernels(model: nn.Module) -> list[str] | None:
    """Turn Transformers' kernelization off in every Transformers model inside `model` (a PEFT or
    other wrapper included) and drop the instance-level forwards it set on marked modules.

    Returns None when nothing was kernelized, else what Hub kernels had replaced, one
    `'Class.forward -> kernel'` entry per class (empty where kernelize only bound each class's own
    forward, as on devices its mapping has no kernel for, CPU included), for the prepared line
    (`ModelState.hub_kernels` of the Qwen3.5 model inside). Idempotent: None the second time.
    """
    marked = [m for m in model.modules() if hasattr(type(m), "kernel_layer_name") and _kernelize_forward(m) is not None]
    kernelizing = [m for m in model.modules() if getattr(m, "_use_kernels", False) is True]  # PreTrainedModels
    if not marked and not kernelizing:
        return None
    replaced = {
        f"{type(m).__name__}.forward": getattr(f.__func__, "__qualname__", repr(f.__func__))
        for m in marked
        if (f := _kernelize_forward(m)) is not None and f.__func__ is not getattr(type(m), "forward", None)
    }
    for module in kernelizing:
        module.use_kernels = False  # Transformers' reset: own forwards bound again, and no kernelize in train()
        module._use_kernels, module._kernels_mode = False, None  # also where the reset cannot run (no `kernels`)
    for module in model.modules():
        if hasattr(type(module), "kernel_layer_name") and _kernelize_forward(module) is not None:
            del module.__dict__["forward"]
    found = [f"{name} -> {kernel}" for name, kernel in sorted(replaced.items())]
    from .detect import unwrap_qwen35
    from .state import own_state

    own_state(unwrap_qwen35(model)).hub_kernels = found
    return found


def swap_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """`module.__class__ = cls`, so that `cls.forward` is what runs: an instance-level `forward`
    bound to the module (kernelize's) is dropped, since it would shadow the new class's."""
    module.__class__ = cls
    if _kernelize_forward(module) is not None:
        del module.__dict__["forward"]
