"""What one preparation made, in one object: `Preparation`, handed to each step of
`PARALLELIZER.apply`'s pipeline and then kept on the model, where every later reader finds it
(`prepared_state`): the model and its parts, the mesh's dims, the options, who prepared it.

It is kept in the model's one `ModelState` (`model/state.py`, with what each installer made),
shared by the model as passed and the Qwen3.5 model inside it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..model.detect import Qwen35Parts
from ..model.state import STATE_ATTR, find_state, own_state
from .expert_parallel.experts import ExpertMesh
from .mesh import ParallelDims
from .options import ParallelOptions

if TYPE_CHECKING:
    from ..settings import PluginSettings

SOURCES: tuple[str, ...] = ("apply", "accelerate", "distributed_config")


@dataclasses.dataclass
class Preparation:
    """What one `PARALLELIZER.apply` call works on, handed to each step of the pipeline in order, and
    afterwards the prepared state every reader asks (`prepared_state`): the model as passed (`model`:
    a PEFT wrapper stays outside) and the Qwen3.5 model inside it (`base`), its parts (located once),
    the mesh's dims and the FSDP2 mesh, the configuration it ran with (`settings`, the one
    `PluginSettings`; its `parallel` are the options in effect, `options`); what the steps made (`converted`: layers given
    an fp32 gate holder; `expert_mesh` under EP; `checkpointing`: which activation checkpointing runs,
    in words; `compiled`: what torch.compile compiled, in words, "" for nothing); who prepared it
    (`source`)."""

    model: nn.Module
    base: nn.Module
    parts: Qwen35Parts
    dims: ParallelDims
    fsdp_mesh: DeviceMesh
    settings: PluginSettings
    converted: int = 0
    expert_mesh: ExpertMesh | None = None
    checkpointing: str = "none"
    compiled: str = ""
    # Who prepared it: "apply" (a custom loop), "accelerate" (the plugin's Accelerate preparation) or
    # "distributed_config" (Transformers' sharding at load, taken over).
    source: str = "apply"

    @property
    def options(self) -> ParallelOptions:
        """The parallelizer's options in effect (validated): the configuration's `parallel` branch."""
        return self.settings.parallel

    @property
    def sizes(self) -> dict[str, int]:
        """The parallel sizes of this preparation: dp_replicate, dp_shard, cp, tp (the mesh's) and ep."""
        dims = self.dims
        return {"dp_replicate": dims.dp_replicate, "dp_shard": dims.size(dims.dp_shard_cp_name) // dims.cp_size,
                "cp": dims.cp_size, "tp": dims.tp_size, "ep": self.options.ep}

    @property
    def global_balance(self) -> bool:
        """The MoE router's balance over the global batch (a model without sparse blocks has no router)."""
        return self.options.moe_balance == "global" and bool(self.parts.moe_blocks)


def attach_preparation(prep: Preparation) -> None:
    """Keep `prep` in the state of the Qwen3.5 model inside, and share that state with the model as
    passed (a PEFT wrapper)."""
    state = own_state(prep.base)
    state.preparation = prep
    prep.model.__dict__[STATE_ATTR] = state


def prepared_state(model: nn.Module | None) -> Preparation | None:
    """The `Preparation` of a model `PARALLELIZER.apply` prepared, looked up through DDP's `.module`,
    torch.compile's and PEFT's wrappers; None for any other model (or None)."""
    state = find_state(model)
    return state.preparation if state is not None else None


def prepared_by_accelerate(model: nn.Module | None) -> bool:
    """Whether the plugin's Accelerate preparation prepared `model` (its step hooks, evaluation and
    checkpoint integrations act on such models only)."""
    state = prepared_state(model)
    return state is not None and state.source == "accelerate"
