"""Every choice `PARALLELIZER.apply` takes, in one frozen object (issue 46's item 7; torchtitan's
job config plays this part there).

`ParallelOptions()` holds the defaults; `PARALLELIZER.apply(model, mesh, options=…)` takes one, and
its keyword arguments (the same names) still build one, so custom loops keep working.
`ParallelOptions.from_settings` is what the plugin, Transformers' `distributed_config` take-over and
`plan` pass: every `QWEN35_ACCEL_*` knob that chooses how a model is parallelized, in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

FrozenMultimodalSharding = Literal["root", "replicate", "shard"]
FROZEN_MULTIMODAL_SHARDING_CHOICES: tuple[str, ...] = ("root", "replicate", "shard")
Fp32HolderUnits = Literal["per_layer", "model"]
FP32_HOLDER_UNITS_CHOICES: tuple[str, ...] = ("per_layer", "model")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {choices}")


# Fields whose plugin setting has another name (the rest share theirs: `ep`, `tiled_loss`, …).
_SETTING_NAMES = {"enable_fsdp2_prefetch": "fsdp2_prefetch"}


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """How `PARALLELIZER.apply` parallelizes a Qwen3.5 model (see its docstring for each field's
    meaning). `checked()` validates the choices and normalises `tiled_loss` (True / False are
    "recompute" / "off")."""

    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    activation_checkpointing: bool = False
    activation_offload: bool = False
    reshard_after_forward: bool | int | None = None
    enable_fsdp2_prefetch: bool = True
    fsdp2_backward_prefetch_depth: int = 2
    fsdp2_forward_prefetch_depth: int = 1
    frozen_multimodal_sharding: FrozenMultimodalSharding = "root"
    dp_replicate_mesh_name: str = "dp_replicate"
    cp_mesh_name: str = "cp"
    tp_mesh_name: str = "tp"
    fp32_holder_units: Fp32HolderUnits = "per_layer"
    vocab_parallel_lm_head: bool = False
    cp_state_exchange: str = "auto"
    tiled_loss: bool | str = "recompute"
    moe_balance: str = "rank"
    ep: int = 1

    def checked(self) -> ParallelOptions:
        """These options, validated (ValueError naming the field and its choices), `tiled_loss` normalised."""
        from .context_parallel.state_exchange import EXCHANGES
        from .moe import BALANCE_CHOICES
        from .tiled_loss import tiled_loss_choice

        check_choice("frozen_multimodal_sharding", self.frozen_multimodal_sharding, FROZEN_MULTIMODAL_SHARDING_CHOICES)
        check_choice("fp32_holder_units", self.fp32_holder_units, FP32_HOLDER_UNITS_CHOICES)
        check_choice("cp_state_exchange", self.cp_state_exchange, EXCHANGES)
        check_choice("moe_balance", self.moe_balance, BALANCE_CHOICES)
        if self.activation_offload and not self.activation_checkpointing:
            raise ValueError("activation_offload=True moves what checkpointed layers keep to host memory: it needs activation_checkpointing=True")
        return dataclasses.replace(self, tiled_loss=tiled_loss_choice(self.tiled_loss))

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> ParallelOptions:
        """The options the plugin's `QWEN35_ACCEL_*` settings (`PluginSettings`) choose (every field
        a setting of the same name, or `_SETTING_NAMES`' name, has), with `overrides` (what
        Accelerate's config decides: policies, checkpointing, resharding)."""
        names = {field.name: _SETTING_NAMES.get(field.name, field.name) for field in dataclasses.fields(cls)}
        chosen = {field: getattr(settings, name) for field, name in names.items() if hasattr(settings, name)}
        return cls(**{**chosen, **overrides})
