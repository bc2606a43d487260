"""The parallelizer of Qwen3.5 models (dense and MoE): surgery, EP, TP, AC, FSDP2, CP, in that order.

`PARALLELIZER.apply(model, device_mesh, options=…)` is the one entry point; the Accelerate
integration calls it with the plugin's settings (`ParallelOptions.from_settings`), custom loops
call it directly (keyword arguments build the options). The model's parts are located once here
and handed to every step.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from .model.detect import FAMILIES, Qwen35Parts, qwen35_parts, unwrap_qwen35
from .model.fp32_gate import HOLDER_NAME, install_fp32_gate
from .parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpoint_targets,
    describe_checkpoint_targets,
    vision_tower_trains,
)
from .parallel.activation_offload import ACTIVATION_OFFLOAD_ATTR, ActivationOffload
from .parallel.expert_parallel import (
    ExpertMesh,
    build_expert_mesh,
    check_expert_parallel,
    install_expert_parallel,
    shard_experts,
)
from .parallel.expert_tensor_parallel import HELD_ATTR
from .parallel.context_parallel.model import (
    check_context_parallel_supported,
    install_context_parallel,
)
from .parallel.fsdp import (
    fp32_compute_policy,
    fully_shard_by_dtype,
    set_async_unshard_on_cpu,
    set_layer_prefetch,
    shard_unit,
    unit_record,
)
from .parallel.mesh import ParallelDims, mesh_device, mesh_dim_names, mesh_dim_size
from .parallel.moe import check_global_balance, check_no_expert_adapters, install_global_balance
from .parallel.options import (
    FP32_HOLDER_UNITS_CHOICES,
    FROZEN_MULTIMODAL_SHARDING_CHOICES,
    Fp32HolderUnits,
    FrozenMultimodalSharding,
    ParallelOptions,
    check_choice,
)
from .parallel.tiled_loss import install_tiled_loss, tiled_loss_mode
from .parallel.tensor_parallel import (
    apply_tensor_parallel,
    apply_vocab_parallel_lm_head,
    check_vocab_parallel,
)
from .parallel.tensor_parallel import check_divisible as check_tp_divisible
from .parallel.tensor_parallel import check_no_cpu_offload
from .parallel.vision import install_vision_placeholder, vision_tower_has_units

# mesh_dim_names / mesh_dim_size / mesh_device: re-exported from parallel.mesh for existing callers.
__all__ = [
    "FROZEN_MULTIMODAL_SHARDING_CHOICES", "FP32_HOLDER_UNITS_CHOICES", "PARALLELIZER", "ParallelOptions",
    "Qwen3_5ModelParallelizer", "mesh_device", "mesh_dim_names", "mesh_dim_size",
]

logger = logging.getLogger(__name__)

class Qwen3_5ModelParallelizer:
    """Applies qwen35-accel's parallelism to a Qwen3.5 model (dense or MoE), in place."""

    # Submodules (by last name) whose parameters compute in fp32 whatever the policy.
    fp32_compute_module_names: tuple[str, ...] = (HOLDER_NAME,)

    def apply(
        self,
        model: nn.Module,
        device_mesh: DeviceMesh,
        dp_shard_cp_mesh_name: str = "dp_shard_cp",
        *,
        options: ParallelOptions | None = None,
        **keywords: Any,
    ) -> nn.Module:
        """Parallelize `model` over `device_mesh` and return it (the same object).

        `options` (`ParallelOptions`, default: its defaults) holds every choice below; keyword
        arguments of the same names build it, or change the given one's fields (TypeError for a
        name it lacks): `mp_policy`, `offload_policy`, `activation_checkpointing`,
        `activation_offload`, `reshard_after_forward`, `enable_fsdp2_prefetch`,
        `fsdp2_backward_prefetch_depth`, `fsdp2_forward_prefetch_depth`,
        `frozen_multimodal_sharding`, `dp_replicate_mesh_name`, `cp_mesh_name`, `tp_mesh_name`,
        `fp32_holder_units`, `vocab_parallel_lm_head`, `cp_state_exchange`, `tiled_loss`,
        `moe_balance`, `ep`.

        Steps: fp32 gate holders (`install_fp32_gate`), TP (tp > 1: head-parallel
        `apply_tensor_parallel` on the `tp` dim; build the optimizer afterwards), activation
        checkpointing per decoder layer and, when the vision tower trains, per vision block
        (`checkpoint_targets`; with `activation_offload` their saved inputs live in host memory
        between forward and backward, `parallel.activation_offload`: the model's
        `_qwen35_activation_offload` counts what moved), dtype-uniform FSDP2 units (`apply_fsdp_sharding`)
        over `dp_shard_cp`, then CP (cp > 1: `install_context_parallel` on the `cp` dim;
        the model then expects each rank's part of the batch, see
        `qwen35_accel.context_parallel.shard_batch`).

        `vocab_parallel_lm_head=True` (tp > 1): the lm_head is split by vocab too and the
        loss combines the slices (`apply_vocab_parallel_lm_head`): `logits` then hold this
        rank's vocab slice. Needs untied embeddings and tp dividing the vocab size.
        `cp_state_exchange` (cp > 1): "allgather", "scan" or "auto", how the GatedDeltaNet
        layers pass chunk summaries across the cp ranks (`install_context_parallel`).
        VLMs whose vision blocks become FSDP2 units (a trainable tower, or frozen with
        `frozen_multimodal_sharding="shard"`) run the tower on a zero placeholder image in
        forwards without images or videos, its output added times zero, so ranks with and
        without images issue the same collectives (`install_vision_placeholder`).
        `tiled_loss` "recompute" (or True) or "hold" (`Qwen3_5ForCausalLM` and the VLM): training
        forwards with labels compute the lm_head and the loss in blocks of tokens and vocab
        rows and return `logits=None` (`install_tiled_loss`; "recompute" keeps the hidden
        states and recomputes the blocks in backward; "hold" holds the gradients, a
        weight-sized one among them, from forward); other forwards keep Transformers' logits.
        "off" (or False): Transformers' loss.
        `moe_balance` (Qwen3.5-MoE, `output_router_logits`): "rank" — the router's
        load-balancing loss over each data-parallel rank's tokens (Transformers' meaning; whole
        rows under cp); "global" — over the global batch (its sums all-reduced over dp_shard ×
        cp, in the tiled training loss; not with HSDP). Dense models ignore it.
        `ep` (Qwen3.5-MoE): expert parallelism, each of `ep` ranks holding `num_experts / ep`
        whole experts per layer and tokens exchanged by all-to-all; the ep groups are carved
        out of dp_shard × cp (consecutive ranks), the ranks holding the same experts shard them
        with FSDP2 (`parallel.expert_parallel`). `ep` must divide the experts and dp_shard × cp
        (ValueError with the numbers); 1: every rank holds every expert.

        Preconditions: `torch.distributed` is initialised; `model` is a Qwen3.5 model, dense or
        MoE (TypeError otherwise),
        possibly inside a PEFT LoRA wrapper, not yet sharded; `device_mesh` has a dim (own or
        flattened) named `dp_shard_cp_mesh_name` (ValueError otherwise). The
        `dp_replicate`, `cp` and `tp` dims are optional (absent = size 1); a replicate
        dim of size > 1 gives HSDP over (`dp_replicate`, `dp_shard_cp`).
        """
        opts = dataclasses.replace(options or ParallelOptions(), **keywords).checked()
        parts = qwen35_parts(model, families=FAMILIES)  # TypeError for anything but Qwen3.5; computed once, handed down
        # A PEFT wrapper (LoRA) stays the outer module and becomes the root unit, as in stock
        # Accelerate; every model-level step acts on the Qwen3.5 model inside it.
        base = unwrap_qwen35(model)
        if isinstance(model, FSDPModule):
            raise ValueError(f"{type(model).__name__} is already sharded by FSDP2; apply the parallelizer once, to the unsharded model.")
        dims = ParallelDims(device_mesh, opts.dp_replicate_mesh_name, dp_shard_cp_mesh_name, opts.cp_mesh_name, opts.tp_mesh_name)
        tp_size, cp_size = dims.tp_size, dims.cp_size
        check_expert_parallel(parts, ep=opts.ep, data_ranks=dims.size(dims.dp_shard_cp_name), dp_replicate=dims.dp_replicate,
                              tp_size=tp_size)
        check_no_expert_adapters(parts.moe_blocks)
        global_balance = opts.moe_balance == "global" and parts.family == "moe"  # dense models have no router
        if global_balance:
            check_global_balance(dp_replicate=dims.dp_replicate)
        check_no_cpu_offload(opts.offload_policy, tp_size)  # before any change, on every rank
        if tp_size > 1:
            check_tp_divisible(base.config.get_text_config(), tp_size)
            if opts.vocab_parallel_lm_head:
                check_vocab_parallel(base, tp_size, parts=parts)
        if cp_size > 1:
            check_context_parallel_supported(base)
        fsdp_mesh = dims.fsdp

        converted = install_fp32_gate(model)  # the outer module too: one parameter naming from the root down
        # Under tp, ep splits each tp rank's experts over the dense FSDP2 mesh (`expert_tensor_parallel`).
        expert_mesh = build_expert_mesh(dims, opts.ep) if opts.ep > 1 and dims.tp is None else None
        if expert_mesh is not None:
            install_expert_parallel(parts, expert_mesh)
        if dims.tp is not None:
            apply_tensor_parallel(base, dims.tp, parts=parts, ep_mesh=fsdp_mesh if opts.ep > 1 else None,
                                  expert_compute_dtype=opts.mp_policy.param_dtype if opts.mp_policy else None)
            if opts.vocab_parallel_lm_head:
                apply_vocab_parallel_lm_head(base, dims.tp, parts=parts)
        if opts.tiled_loss != "off":  # before FSDP2, whose class swap then subclasses this one
            install_tiled_loss(base, mode=opts.tiled_loss)
        if opts.activation_checkpointing:
            offload = ActivationOffload() if opts.activation_offload else None
            apply_activation_checkpointing(checkpoint_targets(parts), offload)
            if offload is not None:
                setattr(model, ACTIVATION_OFFLOAD_ATTR, offload)
        self.apply_fsdp_sharding(
            model,
            fsdp_mesh,
            opts.mp_policy,
            offload_policy=opts.offload_policy,
            enable_fsdp2_prefetch=opts.enable_fsdp2_prefetch,
            fsdp2_backward_prefetch_depth=opts.fsdp2_backward_prefetch_depth,
            fsdp2_forward_prefetch_depth=opts.fsdp2_forward_prefetch_depth,
            reshard_after_forward=opts.reshard_after_forward,
            frozen_multimodal_sharding=opts.frozen_multimodal_sharding,
            fp32_holder_units=opts.fp32_holder_units,
            parts=parts,
            expert_mesh=expert_mesh,
        )
        if vision_tower_has_units(parts.vision_model):
            # Vision blocks with FSDP2 units need every rank in every forward, images or not.
            install_vision_placeholder(base)
        if dims.cp is not None:
            install_context_parallel(base, dims.cp, state_exchange=opts.cp_state_exchange, parts=parts)
        if global_balance:
            install_global_balance(base, fsdp_mesh)
        logger.info(
            "qwen35_accel: %s parallelized on mesh %s (fp32 gate holders installed: %d, activation checkpointing: %s, "
            "cp: %d, tp: %d, ep: %d, tiled loss: %s)",
            type(model).__name__,
            fsdp_mesh,
            converted,
            (describe_checkpoint_targets(parts) + (", saved inputs in host memory" if opts.activation_offload else ""))
            if opts.activation_checkpointing else "off",
            cp_size,
            tp_size,
            opts.ep,
            tiled_loss_mode(base),
        )
        return model

    def apply_fsdp_sharding(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None,
        offload_policy: OffloadPolicy | None = None,
        enable_fsdp2_prefetch: bool = True,
        fsdp2_backward_prefetch_depth: int = 2,
        fsdp2_forward_prefetch_depth: int = 1,
        reshard_after_forward: bool | int | None = None,
        frozen_multimodal_sharding: FrozenMultimodalSharding = "root",
        ignored_multimodal_params: set[nn.Parameter] | None = None,
        *,
        fp32_holder_units: Fp32HolderUnits = "per_layer",
        parts: Qwen35Parts | None = None,
        expert_mesh: ExpertMesh | None = None,
    ) -> None:
        """Shard a dense Qwen3.5 model into dtype-uniform FSDP2 units, bottom-up.

        Units: per decoder layer `fully_shard_by_dtype` (every `_fp32_params` holder an
        fp32 unit, the rest of the layer with `mp_policy`); vision blocks one unit each
        when the vision tower trains, else per `frozen_multimodal_sharding` ("root": left
        to the root unit; "replicate": not sharded, its parameters added to
        `ignored_multimodal_params` and moved to the mesh's device; "shard": a unit per
        block); the input embedding; a tail of final norm + lm_head kept gathered after
        forward (tied embeddings: the embedding joins the tail, so exactly one unit owns
        the shared weight); the root. Then explicit prefetch in layer order, the embedding
        and the tail at the chain's ends (`set_layer_prefetch`), and on CPU meshes
        asynchronous all-gathers (`set_async_unshard_on_cpu`).

        `fp32_holder_units="model"` puts the holders of all decoder layers into one fp32
        unit instead: gathered once per step (with layer 0, while the embedding runs) and
        reduced once, 2 collectives per step instead of 2 per GatedDeltaNet layer, for a
        few KiB of memory (2 x value heads floats per layer, kept gathered from forward to
        the end of backward). Worth it where a collective's latency is large against a
        layer's compute (gloo, small models).

        Routed experts split by `split_experts` (expert parallelism, `expert_mesh` given; or tp)
        become a unit of their own per layer over the ranks holding the same experts
        (`shard_experts`), before the layer's units.
        """
        check_choice("fp32_holder_units", fp32_holder_units, FP32_HOLDER_UNITS_CHOICES)
        parts = parts or qwen35_parts(module, families=FAMILIES)
        policy = mp_policy or MixedPrecisionPolicy()
        common = dict(
            mesh=mesh,
            mp_policy=policy,
            offload_policy=offload_policy,
            fp32_compute_module_names=self.fp32_compute_module_names,
        )
        ignored: set[nn.Parameter] = ignored_multimodal_params if ignored_multimodal_params is not None else set()

        shared_holder_unit: FSDPModule | None = None
        if fp32_holder_units == "model":
            holders = [
                sub
                for layer in parts.decoder_layers
                for name, sub in layer.named_modules()
                if name.rsplit(".", 1)[-1] in self.fp32_compute_module_names and any(True for _ in sub.parameters())
            ]
            if holders:  # fully_shard_by_dtype below leaves these (already FSDP) alone
                shard_unit(holders, mesh=mesh, mp_policy=fp32_compute_policy(policy), reshard_after_forward=False,
                           offload_policy=offload_policy or OffloadPolicy())
                shared_holder_unit = holders[0]

        # Experts held by ep x tp stay out of FSDP2 (their DTensors over `mesh` are the split already).
        held = {p for block in parts.moe_blocks if hasattr(block.experts, HELD_ATTR) for p in block.experts.parameters()}
        split = [block.experts for block in parts.moe_blocks
                 if isinstance(block.experts.gate_up_proj, DTensor) and not hasattr(block.experts, HELD_ATTR)]
        if split:  # by ep (over the ranks holding the same experts) or tp (over the dp ranks)
            shard_experts(
                split,
                expert_mesh.fsdp if expert_mesh is not None else mesh,
                mp_policy=policy,
                offload_policy=offload_policy,
                reshard_after_forward=reshard_after_forward,
                divide_by=expert_mesh.data_ranks if expert_mesh is not None else None,
            )
        layer_units = [
            fully_shard_by_dtype(layer, reshard_after_forward=reshard_after_forward, ignored_params=held, **common)
            for layer in parts.decoder_layers
        ]

        if parts.vision_model is not None:
            if vision_tower_trains(parts) or frozen_multimodal_sharding == "shard":
                for block in parts.vision_blocks:
                    fully_shard_by_dtype(block, reshard_after_forward=reshard_after_forward, **common)
            elif frozen_multimodal_sharding == "replicate":
                device = mesh_device(mesh)
                for p in parts.vision_model.parameters():
                    if p.device.type != "meta" and p.device != device:
                        p.data = p.data.to(device)
                    ignored.add(p)

        lm_head_weight = getattr(parts.lm_head, "weight", None)
        tied = lm_head_weight is not None and lm_head_weight is parts.embed_tokens.weight
        if not tied:
            fully_shard_by_dtype(parts.embed_tokens, reshard_after_forward=reshard_after_forward, **common)
        # The tail runs last in forward and first in backward: resharding it after
        # forward would only add an all-gather that nothing can hide.
        head = parts.lm_head if parts.lm_head is not None else parts.head  # a classifier's score: the tail too
        tail = [m for m in ((parts.embed_tokens,) if tied else ()) + (parts.final_norm, head) if m is not None]
        tail_dtypes = {p.dtype for m in tail for p in m.parameters() if p.requires_grad}
        if len(tail_dtypes) <= 1:
            shard_unit(tail, mesh=mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload_policy or OffloadPolicy())
        elif not tied:  # e.g. an fp32 final norm beside a bf16 lm_head: one unit each
            for m in tail:
                fully_shard_by_dtype(m, reshard_after_forward=False, **common)
        else:
            raise ValueError(
                f"the tied embedding/lm_head and the final norm hold trainable parameters of dtypes {sorted(map(str, tail_dtypes))}; "
                "they must share one FSDP2 unit, which needs one dtype. Cast the final norm to the embedding's dtype."
            )
        # Root: FSDP2's default (None) keeps the root gathered after forward.
        fully_shard_by_dtype(module, reshard_after_forward=None, ignored_params=ignored | held, **common)

        if enable_fsdp2_prefetch:
            if shared_holder_unit is not None and layer_units:
                # Gathered with layer 0 (while the embedding runs), kept to the end of backward.
                layer_units[0] = [*layer_units[0], shared_holder_unit]
            set_layer_prefetch(
                layer_units,
                forward_depth=fsdp2_forward_prefetch_depth,
                backward_depth=fsdp2_backward_prefetch_depth,
                before=_unit_of(parts.embed_tokens),
                after=_unit_of(head) or _unit_of(parts.final_norm),
            )
        if set_async_unshard_on_cpu(module, mesh.device_type):
            logger.debug("CPU mesh: FSDP2 all-gathers are asynchronous (prefetches overlap compute)")


def _unit_of(module: nn.Module | None) -> FSDPModule | None:
    """`module` if it is (part of) an FSDP2 unit made here that manages parameters, else None."""
    record = unit_record(module) if isinstance(module, FSDPModule) else None
    return module if record is not None and any(record.param_names) else None


PARALLELIZER = Qwen3_5ModelParallelizer()
