"""What the package put on one model, in one object: `ModelState`, kept in the model's `__dict__`
under one name (never a submodule or a parameter: checkpoints and `named_modules()` do not see it).

Every installer records here what it made (the CP mesh, the vocab-parallel group, the router's
balance group, the tiled loss, the activation offload, gate values read back, Hub kernels turned
off), whoever calls it: `PARALLELIZER.apply`'s pipeline, the no-FSDP path, or a custom loop calling
an installer alone; `PARALLELIZER.apply` adds its `Preparation` (`parallel/prepared.py`). Readers ask
`state_of` (this module's own state) or `find_state` (through DDP's, torch.compile's and PEFT's
wrappers) instead of walking modules for private attributes. Per-module settings that a module's own
forward reads (a split module's tp group and slices, an experts module's expert mesh, compiled
steps, the packing hook's flag) stay on that module.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from ..parallel.prepared import Preparation

STATE_ATTR = "_qwen35_state"


@dataclasses.dataclass(eq=False)
class ModelState:
    """What was installed on one model (each field None/0/False until its installer runs).

    - `preparation`: the `Preparation` of `PARALLELIZER.apply` (dims, meshes, parts, options, source).
    - `cp_mesh`, `cp_text_model`, `cp_paused`: `install_context_parallel`'s 1-D cp mesh, the text
      decoder that sees this rank's chunks, and whether `context_parallel_paused` holds it paused.
    - `vocab_group`: the tp process group of a vocab-parallel lm_head.
    - `balance_group`: the group the MoE router's global balance reduces over (dp_shard × cp).
    - `tiled_loss`, `tile`: the tiled loss's mode ("recompute" or "hold"; None: Transformers' loss)
      and its tokens per block (None: `tiled_blocks.block_shape`'s).
    - `activation_offload`: the `ActivationOffload` of checkpointed layers' saved inputs.
    - `restored_gates`: gate tensors whose fp32 values were read back from the checkpoint.
    - `hub_kernels`: what Transformers' kernelize had replaced when it was turned off (None: never on).
    - `deepspeed_gates`: the gates kept outside a DeepSpeed engine (`integrations/deepspeed/gates.py`).
    - `tp_optimizers`: the optimizers whose state dicts keep this model's tensor-parallel parameters in
      Transformers' layout (`register_optimizer_state_layout`; weak references).
    """

    preparation: Preparation | None = None
    cp_mesh: DeviceMesh | None = None
    cp_text_model: nn.Module | None = None
    cp_paused: bool = False
    vocab_group: Any = None
    balance_group: Any = None
    tiled_loss: str | None = None
    tile: int | None = None
    activation_offload: Any = None
    restored_gates: int = 0
    hub_kernels: list[str] | None = None
    deepspeed_gates: Any = None
    tp_optimizers: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)


def own_state(model: nn.Module) -> ModelState:
    """`model`'s own state, created on first use (for installers)."""
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        state = model.__dict__[STATE_ATTR] = ModelState()
    return state


def state_of(model: nn.Module | None) -> ModelState:
    """`model`'s own state for reading: an empty one when nothing was installed (or `model` is None);
    never looks inside wrappers (`find_state` does)."""
    state = model.__dict__.get(STATE_ATTR) if isinstance(model, nn.Module) else None
    return state if state is not None else ModelState()


def find_state(model: nn.Module | None) -> ModelState | None:
    """The state of `model` or of the Qwen3.5 model inside it, looked up through DDP's `.module`,
    torch.compile's and PEFT's wrappers; None where nothing was installed."""
    from .detect import unwrap_qwen35

    for module in (model, getattr(model, "module", None)):
        if isinstance(module, nn.Module):
            for candidate in (module, unwrap_qwen35(module)):
                state = candidate.__dict__.get(STATE_ATTR)
                if state is not None:
                    return state
    return None
