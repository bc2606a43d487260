"""Every choice `PARALLELIZER.apply` takes, in one frozen object (issue 46's item 7; torchtitan's
job config plays this part there).

`ParallelOptions()` holds the defaults; `PARALLELIZER.apply(model, mesh, options=…)` takes one, and
its keyword arguments (the same names) still build one, so custom loops keep working.
`ParallelOptions.from_settings` is what the plugin, Transformers' `distributed_config` take-over and
`plan` pass: every `QWEN35_ACCEL_*` knob that chooses how a model is parallelized, in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

FrozenMultimodalSharding = Literal["root", "replicate", "shard"]
FROZEN_MULTIMODAL_SHARDING_CHOICES: tuple[str, ...] = ("root", "replicate", "shard")
Fp32HolderUnits = Literal["per_layer", "model"]
FP32_HOLDER_UNITS_CHOICES: tuple[str, ...] = ("per_layer", "model")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {choices}")


def _knob(default: Any, *help: str, setting: str | None = None) -> Any:
    """A field that is also a `QWEN35_ACCEL_*` knob: its default and help (joined) declared here once
    (`settings.PluginSettings` takes both from here); `setting`: the knob's name where it is not the field's."""
    return dataclasses.field(default=default, metadata={"help": "".join(help), "setting": setting})


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """How `PARALLELIZER.apply` parallelizes a Qwen3.5 model. `checked()` validates the choices and
    normalises `tiled_loss` (True / False are "recompute" / "off"). The fields that are also
    `QWEN35_ACCEL_*` knobs declare their default and one-line help once, here (`_knob`; the plugin's
    `settings.PluginSettings` takes both from these declarations, their choices from the code that acts
    on them). The fields:

    - `mp_policy`, `offload_policy`, `reshard_after_forward`: FSDP2's, for the layers' units (the fp32
      gate holders compute in fp32 whatever `mp_policy` says).
    - `activation_checkpointing`: each decoder layer and, when the vision tower trains, each vision
      block (`checkpoint_targets`); `activation_offload` (needs it): their saved inputs live in host
      memory between forward and backward (`parallel.activation_offload`; the model's
      `ModelState.activation_offload` counts what moved). Transformers' gradient checkpointing, where
      its flags are on (`gradient_checkpointing_enable()`), is turned off on the modules ours
      checkpoints, and with offload on every decoder layer taken over by ours
      (`choose_activation_checkpointing`): no module is checkpointed twice.
    - `compile`: torch.compile's keyword arguments (None: eager): each decoder layer's regions between
      the FSDP2 unit boundaries and CP's collectives are compiled, after sharding
      (`parallel.regional_compile`).
    - `enable_fsdp2_prefetch`, `fsdp2_forward_prefetch_depth`, `fsdp2_backward_prefetch_depth`:
      explicit prefetch of the units in layer order, embedding to tail.
    - `frozen_multimodal_sharding`: a frozen vision tower "root" (in the root unit), "replicate" or
      "shard" (a unit per block). VLMs whose vision blocks become units run the tower on a zero
      placeholder image in forwards without images, so every rank issues the same collectives.
    - `dp_replicate_mesh_name`, `cp_mesh_name`, `tp_mesh_name`: the mesh's dim names (absent = size 1).
    - `fp32_holder_units`: "per_layer" (each GatedDeltaNet's gate holder its own fp32 unit) or "model"
      (one fp32 unit for all of them: 2 collectives a step instead of 2 per GatedDeltaNet layer).
    - `vocab_parallel_lm_head` (tp > 1): the lm_head split by vocab too, the loss combining the slices;
      `logits` then hold this rank's slice. Needs untied embeddings and tp dividing the vocab size.
    - `cp_state_exchange` (cp > 1): "allgather", "scan" or "auto", how the GatedDeltaNet layers pass
      chunk summaries across the cp ranks.
    - `tiled_loss`: "recompute" (or True) or "hold": training forwards with labels compute the lm_head
      and the loss in blocks of tokens and vocab rows and return `logits=None` ("recompute" recomputes
      the blocks in backward; "hold" holds the gradients, a weight-sized one among them, from forward);
      "off" (or False): Transformers' loss.
    - `moe_balance` (Qwen3.5-MoE, `output_router_logits`): "rank" — the router's load-balancing loss
      over each data-parallel rank's tokens (Transformers' meaning; whole rows under cp); "global" —
      over the global batch (its sums all-reduced over dp_shard × cp in the tiled training loss; not
      with HSDP). Dense models ignore it.
    - `ep` (Qwen3.5-MoE): expert parallelism, each of `ep` ranks holding `num_experts / ep` whole
      experts per layer, tokens exchanged by all-to-all; the ep groups are consecutive ranks of
      dp_shard × cp, which `ep` must divide, as it must the experts (ValueError with the numbers).
    """

    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    activation_checkpointing: bool = False
    activation_offload: bool = False
    reshard_after_forward: bool | int | None = None
    compile: Mapping[str, Any] | None = None
    enable_fsdp2_prefetch: bool = _knob(
        True,
        "explicit forward/backward prefetch of the units in layer order, embedding to tail",
        setting="fsdp2_prefetch",
    )
    fsdp2_backward_prefetch_depth: int = _knob(2, "layers prefetched ahead in backward")
    fsdp2_forward_prefetch_depth: int = _knob(1, "layers prefetched ahead in forward")
    frozen_multimodal_sharding: FrozenMultimodalSharding = _knob(
        "root",
        "a frozen vision tower: root (in the root unit), replicate or shard",
    )
    dp_replicate_mesh_name: str = "dp_replicate"
    cp_mesh_name: str = "cp"
    tp_mesh_name: str = "tp"
    fp32_holder_units: Fp32HolderUnits = _knob(
        "per_layer",
        "per_layer: each GatedDeltaNet's fp32 gate holder is an FSDP2 unit of its own; model: one fp32 unit "
        "holds all of them (2 collectives per step instead of 2 per GatedDeltaNet layer)",
    )
    vocab_parallel_lm_head: bool = _knob(
        False,
        "under tp > 1, split the lm_head by vocab too; the loss combines the slices (model outputs then hold "
        "this rank's vocab slice of the logits; needs untied embeddings)",
    )
    cp_state_exchange: str = _knob(
        "auto",
        "under cp > 1, how GatedDeltaNet chunk summaries cross the ranks: allgather (one all-gather, O(cp) "
        "bytes), scan (log-depth, O(log cp) bytes and kept summaries) or auto (by cp size and backend)",
    )
    tiled_loss: bool | str = _knob(
        "recompute",
        "training forwards with labels compute the lm_head and the loss in blocks of tokens and vocab rows, "
        "never holding [tokens, vocab] (the returned logits are then None): recompute (or 1) keeps the "
        "hidden states and one number per token and recomputes the blocks' logits in backward; hold computes "
        "the gradients in forward (the same GEMMs) and holds them until backward, one of the lm_head "
        "weight's size; off (or 0): Transformers' loss from the whole logits",
    )
    moe_balance: str = _knob(
        "rank",
        "Qwen3.5-MoE's router load-balancing loss (output_router_logits): rank counts each data-parallel "
        "rank's tokens (Transformers' meaning; whole rows under cp); global counts the global batch (its "
        "sums all-reduced over dp_shard x cp in the tiled training loss, Qwen's recipe; not with HSDP)",
    )
    ep: int = _knob(
        1,
        "Qwen3.5-MoE: expert parallelism, each of ep ranks holding num_experts/ep whole experts per layer, "
        "tokens sent to their experts' ranks and back by all-to-all; the ep groups are consecutive ranks of "
        "dp_shard x cp (ep must divide it and the experts), the ranks holding the same experts shard them "
        "with FSDP2; 1: off",
    )

    def checked(self) -> ParallelOptions:
        """These options, validated (ValueError naming the field and its choices), `tiled_loss` normalised."""
        from .context_parallel.state_exchange import EXCHANGES
        from .expert_parallel.router import BALANCE_CHOICES
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
        declared a knob, `_knob`: the setting of its name, or of its declared `setting` name), with
        `overrides` (what the engine's config decides: policies, checkpointing, resharding)."""
        names = {f.name: f.metadata["setting"] or f.name for f in dataclasses.fields(cls) if "help" in f.metadata}
        chosen = {field: getattr(settings, name) for field, name in names.items()}
        return cls(**{**chosen, **overrides})
