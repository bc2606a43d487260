"""The parallelizer of Qwen3.5 models (dense and MoE): surgery, EP, TP, AC, FSDP2, CP, in that order.

`PARALLELIZER.apply(model, device_mesh, options=…)` is the one entry point; the Accelerate,
`distributed_config` and `plan` integrations call it with the one configuration
(`settings=PluginSettings.from_env().with_parallel(…)`), custom loops with options (keyword
arguments build them). The model's parts are located once here
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
from .model.state import own_state
from .parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpoint_targets,
    choose_activation_checkpointing,
    vision_tower_trains,
)
from .parallel.activation_offload import ActivationOffload
from .parallel.expert_parallel.experts import (
    ExpertMesh,
    build_expert_mesh,
    check_expert_parallel,
    install_expert_parallel,
    shard_experts,
)
from .parallel.expert_parallel.over_tensor_parallel import HELD_ATTR
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
from .parallel.expert_parallel.router import check_global_balance, check_no_expert_adapters, install_global_balance
from .parallel.prepared import SOURCES, Preparation, attach_preparation
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
from .parallel.vision_placeholder import install_vision_placeholder, vision_tower_has_units
from .settings import PluginSettings

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

    # The pipeline: every step `apply` runs, in order (each a method below, taking the `Preparation`).
    # torch.compile comes last: it compiles the regions between the FSDP2 units' hooks and CP's collectives.
    pipeline: tuple[str, ...] = (
        "validate", "gate_holders", "expert_parallel", "tensor_parallel", "loss", "activation_checkpointing",
        "fsdp2", "vision_placeholder", "context_parallel", "global_balance", "compile",
    )

    def apply(
        self,
        model: nn.Module,
        device_mesh: DeviceMesh,
        dp_shard_cp_mesh_name: str = "dp_shard_cp",
        *,
        options: ParallelOptions | None = None,
        settings: PluginSettings | None = None,
        source: str = "apply",
        **keywords: Any,
    ) -> nn.Module:
        """Parallelize `model` over `device_mesh` and return it (the same object): the steps of
        `pipeline` in order — checks of every choice before any change, fp32 gate holders
        (`install_fp32_gate`), EP, head-parallel TP (build the optimizer afterwards), the tiled
        loss, activation checkpointing (ours or Transformers', never both; offload), dtype-uniform
        FSDP2 units over `dp_shard_cp` (HSDP with a `dp_replicate` dim of size > 1), the vision
        placeholder, CP (the model then expects each rank's part of the batch:
        `qwen35_accel.context_parallel.shard_batch`), the MoE router's global balance, torch.compile
        of each layer's regions.

        `options` (`ParallelOptions`, whose docstring gives each field's meaning; default: its
        defaults) holds every choice; keyword arguments of its field names build it, or change the
        given one's fields (TypeError for a name it lacks). `settings` (the one configuration,
        `PluginSettings`, what the integrations pass) instead: its `parallel` are the options, and
        the prepared state keeps it whole; without it the plugin's own knobs are at their defaults.
        `source`: who prepares (`parallel.prepared.SOURCES`; the integrations pass theirs).

        Preconditions: `torch.distributed` is initialised; `model` is a Qwen3.5 model, dense or MoE
        (TypeError otherwise), possibly inside a PEFT LoRA wrapper (which stays the outer module and
        becomes the root unit, as in stock Accelerate), not yet sharded; `device_mesh` has a dim (own
        or flattened) named `dp_shard_cp_mesh_name` (ValueError otherwise); the `dp_replicate`, `cp`
        and `tp` dims are optional (absent = size 1).
        """
        if options is not None and settings is not None:
            raise TypeError("pass options or settings (whose parallel are the options), not both")
        check_choice("source", source, SOURCES)
        settings = settings or PluginSettings(parallel=options or ParallelOptions())
        opts = dataclasses.replace(settings.parallel, **keywords).checked()
        parts = qwen35_parts(model, families=FAMILIES)  # TypeError for anything but Qwen3.5; located once, handed down
        if isinstance(model, FSDPModule):
            raise ValueError(f"{type(model).__name__} is already sharded by FSDP2; apply the parallelizer once, to the unsharded model.")
        dims = ParallelDims(device_mesh, opts.dp_replicate_mesh_name, dp_shard_cp_mesh_name, opts.cp_mesh_name, opts.tp_mesh_name)
        prep = Preparation(model=model, base=unwrap_qwen35(model), parts=parts, dims=dims, fsdp_mesh=dims.fsdp,
                           settings=dataclasses.replace(settings, parallel=opts), source=source)
        for step in self.pipeline:
            getattr(self, step)(prep)
        attach_preparation(prep)  # what every later reader asks (`parallel.prepared.prepared_state`)
        logger.info(
            "qwen35_accel: %s parallelized on mesh %s (fp32 gate holders installed: %d, activation checkpointing: %s, "
            "cp: %d, tp: %d, ep: %d, tiled loss: %s)",
            type(model).__name__, prep.fsdp_mesh, prep.converted, prep.checkpointing,
            dims.cp_size, dims.tp_size, opts.ep, tiled_loss_mode(prep.base),
        )
        return model

    def validate(self, prep: Preparation) -> None:
        """Every check of the choices against the model and the mesh, on every rank, before any change."""
        parts, dims, opts, base = prep.parts, prep.dims, prep.options, prep.base
        if parts.family == "qwen4" and (dims.cp_size > 1 or dims.tp_size > 1):
            raise NotImplementedError(
                f"qwen35_accel prepares Qwen4-Exp (qwen4_exp) with fp32 gate units under FSDP2/HSDP and EP; context and "
                f"tensor parallelism (here cp={dims.cp_size}, tp={dims.tp_size}) need the n-gram and PLE-conv halos, QSA's "
                "key all-gather and the hyper-connections' TP layout, not built yet (docs/qwen4_exp_design.md)"
            )
        check_expert_parallel(parts, ep=opts.ep, data_ranks=dims.size(dims.dp_shard_cp_name), dp_replicate=dims.dp_replicate,
                              tp_size=dims.tp_size)
        check_no_expert_adapters(parts.moe_blocks)
        if prep.global_balance:
            check_global_balance(dp_replicate=dims.dp_replicate)
        check_no_cpu_offload(opts.offload_policy, dims.tp_size)
        if dims.tp_size > 1:
            check_tp_divisible(base.config.get_text_config(), dims.tp_size)
            if opts.vocab_parallel_lm_head:
                check_vocab_parallel(base, dims.tp_size, parts=parts)
        if dims.cp_size > 1:
            check_context_parallel_supported(base)

    def gate_holders(self, prep: Preparation) -> None:
        """Each GatedDeltaNet's `A_log`/`dt_bias` into an fp32 holder (the outer module too: one
        parameter naming from the root down)."""
        prep.converted = install_fp32_gate(prep.model)

    def expert_parallel(self, prep: Preparation) -> None:
        """EP without tp (under tp, `tensor_parallel` splits each tp rank's experts over the FSDP2 mesh)."""
        if prep.options.ep > 1 and prep.dims.tp is None:
            prep.expert_mesh = build_expert_mesh(prep.dims, prep.options.ep)
            install_expert_parallel(prep.parts, prep.expert_mesh)

    def tensor_parallel(self, prep: Preparation) -> None:
        """Head-parallel decoder layers over the `tp` dim, and the vocab-parallel lm_head if chosen."""
        tp, opts = prep.dims.tp, prep.options
        if tp is None:
            return
        apply_tensor_parallel(prep.base, tp, parts=prep.parts, ep_mesh=prep.fsdp_mesh if opts.ep > 1 else None,
                              expert_compute_dtype=opts.mp_policy.param_dtype if opts.mp_policy else None)
        if opts.vocab_parallel_lm_head:
            apply_vocab_parallel_lm_head(prep.base, tp, parts=prep.parts)

    def loss(self, prep: Preparation) -> None:
        """The tiled training loss (before FSDP2, whose class swap then subclasses this one)."""
        if prep.options.tiled_loss != "off":
            install_tiled_loss(prep.base, mode=prep.options.tiled_loss)

    def activation_checkpointing(self, prep: Preparation) -> None:
        """Checkpointed decoder layers (and trained vision blocks), their saved inputs offloaded if chosen;
        Transformers' checkpointing of the same modules turned off or taken over (`choose_activation_checkpointing`)."""
        asked_by = "Accelerate's fsdp_activation_checkpointing_offload" if prep.source == "accelerate" else "activation_offload=True"
        choice = choose_activation_checkpointing(prep.parts, prep.options.activation_checkpointing, prep.options.activation_offload, asked_by)
        prep.checkpointing = choice.line
        if not choice.ours:
            return
        offload = ActivationOffload() if choice.offload else None
        apply_activation_checkpointing(checkpoint_targets(prep.parts), offload)
        if offload is not None:
            own_state(prep.base).activation_offload = offload

    def fsdp2(self, prep: Preparation) -> None:
        """Dtype-uniform FSDP2 units over the FSDP mesh (`apply_fsdp_sharding`)."""
        opts = prep.options
        self.apply_fsdp_sharding(
            prep.model, prep.fsdp_mesh, opts.mp_policy, offload_policy=opts.offload_policy,
            enable_fsdp2_prefetch=opts.enable_fsdp2_prefetch, fsdp2_backward_prefetch_depth=opts.fsdp2_backward_prefetch_depth,
            fsdp2_forward_prefetch_depth=opts.fsdp2_forward_prefetch_depth, reshard_after_forward=opts.reshard_after_forward,
            frozen_multimodal_sharding=opts.frozen_multimodal_sharding, fp32_holder_units=opts.fp32_holder_units,
            parts=prep.parts, expert_mesh=prep.expert_mesh,
        )

    def vision_placeholder(self, prep: Preparation) -> None:
        """Vision blocks with FSDP2 units need every rank in every forward, images or not."""
        if vision_tower_has_units(prep.parts.vision_model):
            install_vision_placeholder(prep.base)

    def context_parallel(self, prep: Preparation) -> None:
        """CP layers, loss and input checks over the `cp` dim."""
        if prep.dims.cp is not None:
            install_context_parallel(prep.base, prep.dims.cp, state_exchange=prep.options.cp_state_exchange, parts=prep.parts)

    def global_balance(self, prep: Preparation) -> None:
        """The MoE router's load-balancing sums over dp_shard × cp (`moe_balance="global"`)."""
        if prep.global_balance:
            install_global_balance(prep.base, prep.fsdp_mesh)

    def compile(self, prep: Preparation) -> None:
        """torch.compile of each decoder layer's regions between the units' hooks and CP's collectives."""
        if prep.options.compile is not None:
            from .parallel.regional_compile import compile_layer_regions

            prep.compiled = compile_layer_regions(prep.parts, context_parallel=prep.dims.cp is not None, **prep.options.compile)

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
        shared_holder_unit = self._shard_holders_as_one_unit(parts, mesh, policy, offload_policy) if fp32_holder_units == "model" else None
        held = _shard_split_experts(parts, mesh, policy, offload_policy, reshard_after_forward, expert_mesh)
        layer_units = [
            fully_shard_by_dtype(layer, reshard_after_forward=reshard_after_forward, ignored_params=held, **common)
            for layer in parts.decoder_layers
        ]
        _shard_vision_tower(parts, frozen_multimodal_sharding, ignored, reshard_after_forward, common)
        head = _shard_embedding_and_tail(parts, reshard_after_forward, common)
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

    def _shard_holders_as_one_unit(self, parts: Qwen35Parts, mesh: DeviceMesh, policy: MixedPrecisionPolicy,
                                   offload_policy: OffloadPolicy | None) -> FSDPModule | None:
        """`fp32_holder_units="model"`: every decoder layer's gate holders in one fp32 unit, kept
        gathered after forward (`fully_shard_by_dtype` then leaves them alone); None without holders."""
        holders = [
            sub
            for layer in parts.decoder_layers
            for name, sub in layer.named_modules()
            if name.rsplit(".", 1)[-1] in self.fp32_compute_module_names and any(True for _ in sub.parameters())
        ]
        if not holders:
            return None
        shard_unit(holders, mesh=mesh, mp_policy=fp32_compute_policy(policy), reshard_after_forward=False,
                   offload_policy=offload_policy or OffloadPolicy())
        return holders[0]


def _shard_split_experts(parts: Qwen35Parts, mesh: DeviceMesh, policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy | None,
                         reshard_after_forward: bool | int | None, expert_mesh: ExpertMesh | None) -> set[nn.Parameter]:
    """Routed experts split by ep (over the ranks holding the same experts) or tp (over the dp ranks):
    a unit of their own per layer. Returns the parameters of the experts held by ep × tp, which stay
    out of FSDP2 (their DTensors over `mesh` are the split already)."""
    held = {p for block in parts.moe_blocks if hasattr(block.experts, HELD_ATTR) for p in block.experts.parameters()}
    split = [block.experts for block in parts.moe_blocks
             if isinstance(block.experts.gate_up_proj, DTensor) and not hasattr(block.experts, HELD_ATTR)]
    if split:
        shard_experts(
            split,
            expert_mesh.fsdp if expert_mesh is not None else mesh,
            mp_policy=policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
            divide_by=expert_mesh.data_ranks if expert_mesh is not None else None,
        )
    return held


def _shard_vision_tower(parts: Qwen35Parts, frozen_multimodal_sharding: FrozenMultimodalSharding, ignored: set[nn.Parameter],
                        reshard_after_forward: bool | int | None, common: dict[str, Any]) -> None:
    """A VLM's vision blocks: one unit each when the tower trains or `frozen_multimodal_sharding` is
    "shard"; "replicate": not sharded (added to `ignored`, moved to the mesh's device); "root": left
    to the root unit."""
    if parts.vision_model is None:
        return
    if vision_tower_trains(parts) or frozen_multimodal_sharding == "shard":
        for block in parts.vision_blocks:
            fully_shard_by_dtype(block, reshard_after_forward=reshard_after_forward, **common)
    elif frozen_multimodal_sharding == "replicate":
        device = mesh_device(common["mesh"])
        for p in parts.vision_model.parameters():
            if p.device.type != "meta" and p.device != device:
                p.data = p.data.to(device)
            ignored.add(p)


def _shard_embedding_and_tail(parts: Qwen35Parts, reshard_after_forward: bool | int | None, common: dict[str, Any]) -> nn.Module | None:
    """The input embedding's unit and the tail's (final norm + lm_head or a classifier's score, kept
    gathered after forward: it runs last in forward and first in backward, so resharding would only
    add an all-gather nothing can hide). Tied embeddings join the tail, so exactly one unit owns the
    shared weight. Returns the head (lm_head or score)."""
    lm_head_weight = getattr(parts.lm_head, "weight", None)
    tied = lm_head_weight is not None and lm_head_weight is parts.embed_tokens.weight
    if not tied:
        fully_shard_by_dtype(parts.embed_tokens, reshard_after_forward=reshard_after_forward, **common)
    head = parts.lm_head if parts.lm_head is not None else parts.head
    tail = [m for m in ((parts.embed_tokens,) if tied else ()) + (parts.final_norm, head) if m is not None]
    tail_dtypes = {p.dtype for m in tail for p in m.parameters() if p.requires_grad}
    if len(tail_dtypes) <= 1:
        shard_unit(tail, mesh=common["mesh"], reshard_after_forward=False, mp_policy=common["mp_policy"],
                   offload_policy=common["offload_policy"] or OffloadPolicy())
    elif not tied:  # e.g. an fp32 final norm beside a bf16 lm_head: one unit each
        for m in tail:
            fully_shard_by_dtype(m, reshard_after_forward=False, **common)
    else:
        raise ValueError(
            f"the tied embedding/lm_head and the final norm hold trainable parameters of dtypes {sorted(map(str, tail_dtypes))}; "
            "they must share one FSDP2 unit, which needs one dtype. Cast the final norm to the embedding's dtype."
        )
    return head


def _unit_of(module: nn.Module | None) -> FSDPModule | None:
    """`module` if it is (part of) an FSDP2 unit made here that manages parameters, else None."""
    record = unit_record(module) if isinstance(module, FSDPModule) else None
    return module if record is not None and any(record.param_names) else None


PARALLELIZER = Qwen3_5ModelParallelizer()
