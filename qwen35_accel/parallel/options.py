"""Every choice `PARALLELIZER.apply` takes, in one frozen object: the `parallel` branch of the one
configuration, `settings.PluginSettings` (torchtitan's job config plays this part there).

`ParallelOptions()` holds the defaults; `PARALLELIZER.apply(model, mesh, options=…)` takes one, and
its keyword arguments (the same names) still build one, so custom loops keep working. The plugin,
Transformers' `distributed_config` take-over and `plan` pass the whole configuration instead
(`apply(…, settings=PluginSettings.from_env().with_parallel(…))`): its `parallel` holds the
`QWEN35_ACCEL_*` knobs declared here (`knob`), read from the environment, and the engine's choices.

Each knob is declared once, by `knob`: its default, its help (docs/configuration.md and `qwen35-accel
env` print it) and, for a choice, its choices, which the code acting on it imports from here.
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
# Imported by the code that acts on them (context_parallel.state_exchange, expert_parallel.router,
# tiled_head / tiled_loss): declared here, with their knobs.
CP_STATE_EXCHANGE_CHOICES: tuple[str, ...] = ("auto", "allgather", "scan")
MOE_BALANCE_CHOICES: tuple[str, ...] = ("rank", "global")
TILED_LOSS_CHOICES: tuple[str, ...] = ("off", "recompute", "hold")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {choices}")


def knob(default: Any, *help: str, setting: str | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field that is a `QWEN35_ACCEL_*` knob (here and in `settings.PluginSettings`): its
    default, its help (the strings joined), its choices for a choice knob, and `setting`, the knob's
    name where it is not the field's. Declared once: the environment's parser, `checked()`, the
    settings table and the docs read these."""
    return dataclasses.field(default=default, metadata={"help": "".join(help), "setting": setting, "choices": choices})


def tiled_loss_choice(value: bool | str) -> str:
    """`value` as one of `TILED_LOSS_CHOICES`: True is the default mode ("recompute"), False "off"."""
    mode = (TILED_LOSS_CHOICES[1] if value else "off") if isinstance(value, bool) else value
    if mode not in TILED_LOSS_CHOICES:
        raise ValueError(f"tiled_loss={value!r}: expected one of {list(TILED_LOSS_CHOICES)} (or True/False)")
    return mode


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """How `PARALLELIZER.apply` parallelizes a Qwen3.5 model. `checked()` validates the choices and
    normalises `tiled_loss` (True / False are "recompute" / "off"). The fields that are also
    `QWEN35_ACCEL_*` knobs declare their default, help and choices once, here (`knob`; the
    configuration, `settings.PluginSettings`, reads them from the environment into its `parallel`).
    The fields:

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
    enable_fsdp2_prefetch: bool = knob(
        True,
        "explicit forward/backward prefetch of the units in layer order, embedding to tail",
        setting="fsdp2_prefetch",
    )
    fsdp2_backward_prefetch_depth: int = knob(2, "layers prefetched ahead in backward")
    fsdp2_forward_prefetch_depth: int = knob(1, "layers prefetched ahead in forward")
    frozen_multimodal_sharding: FrozenMultimodalSharding = knob(
        "root",
        "a frozen vision tower: root (in the root unit), replicate or shard",
        choices=FROZEN_MULTIMODAL_SHARDING_CHOICES,
    )
    dp_replicate_mesh_name: str = "dp_replicate"
    cp_mesh_name: str = "cp"
    tp_mesh_name: str = "tp"
    fp32_holder_units: Fp32HolderUnits = knob(
        "per_layer",
        "per_layer: each GatedDeltaNet's fp32 gate holder is an FSDP2 unit of its own; model: one fp32 unit "
        "holds all of them (2 collectives per step instead of 2 per GatedDeltaNet layer)",
        choices=FP32_HOLDER_UNITS_CHOICES,
    )
    vocab_parallel_lm_head: bool = knob(
        False,
        "under tp > 1, split the lm_head by vocab too; the loss combines the slices (model outputs then hold "
        "this rank's vocab slice of the logits; needs untied embeddings)",
    )
    cp_state_exchange: str = knob(
        "auto",
        "under cp > 1, how GatedDeltaNet chunk summaries cross the ranks: allgather (one all-gather, O(cp) "
        "bytes), scan (log-depth, O(log cp) bytes and kept summaries) or auto (by cp size and backend)",
        choices=CP_STATE_EXCHANGE_CHOICES,
    )
    tiled_loss: bool | str = knob(
        "recompute",
        "training forwards with labels compute the lm_head and the loss in blocks of tokens and vocab rows, "
        "never holding [tokens, vocab] (the returned logits are then None): recompute (or 1) keeps the "
        "hidden states and one number per token and recomputes the blocks' logits in backward; hold computes "
        "the gradients in forward (the same GEMMs) and holds them until backward, one of the lm_head "
        "weight's size; off (or 0): Transformers' loss from the whole logits",
        choices=TILED_LOSS_CHOICES,
    )
    moe_balance: str = knob(
        "rank",
        "Qwen3.5-MoE's router load-balancing loss (output_router_logits): rank counts each data-parallel "
        "rank's tokens (Transformers' meaning; whole rows under cp); global counts the global batch (its "
        "sums all-reduced over dp_shard x cp in the tiled training loss, Qwen's recipe; not with HSDP)",
        choices=MOE_BALANCE_CHOICES,
    )
    ep: int = knob(
        1,
        "Qwen3.5-MoE: expert parallelism, each of ep ranks holding num_experts/ep whole experts per layer, "
        "tokens sent to their experts' ranks and back by all-to-all; the ep groups are consecutive ranks of "
        "dp_shard x cp (ep must divide it and the experts), the ranks holding the same experts shard them "
        "with FSDP2; 1: off",
    )

    def checked(self) -> ParallelOptions:
        """These options, validated (ValueError naming the field and its declared choices), `tiled_loss`
        normalised."""
        normalised = dataclasses.replace(self, tiled_loss=tiled_loss_choice(self.tiled_loss))
        for field in dataclasses.fields(self):
            if field.metadata.get("choices"):
                check_choice(field.name, getattr(normalised, field.name), field.metadata["choices"])
        if self.activation_offload and not self.activation_checkpointing:
            raise ValueError("activation_offload=True moves what checkpointed layers keep to host memory: it needs activation_checkpointing=True")
        return normalised
