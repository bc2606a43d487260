"""Preparation patch points: Accelerate's FSDP2, TP and CP preparation of a dense Qwen3.5 model.

`prepare_fsdp2` installs the fp32 gate holders before Accelerate records parameter names;
`fsdp2_prepare_model` hands the wrap to `PARALLELIZER.apply` with the FSDP plugin's
settings and the accelerator's mesh (`prepare_qwen35_fsdp2`); `fsdp2_apply_ac` steps
aside (the parallelizer checkpoints each decoder layer and trainable vision block);
`prepare_tp` / `prepare_cp` skip Accelerate's own TP and CP paths, which the parallelizer
replaces. `accelerator_prepare_model.prepare_model` holds the gates in fp32 where no FSDP runs (one process, DDP).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .compilation import compile_note, take_over_compile
from ..notices import main_process_note
from ..prepared_line import experts_note, hub_kernels_note, loss_in_effect, mixed_precision_note
from ...settings import PluginSettings, check_same_on_every_rank
from ..targets import is_plugin_fsdp2_module, prepared_by_accelerate, the_model

logger = logging.getLogger(__name__)

def prepare_fsdp2(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any) -> Any:
        model = the_model(args)
        if model is not None and is_plugin_fsdp2_module(model, self):
            from ...model.fp32_gate import install_fp32_gate

            from ..activation import install

            install()  # the deferred points (transformers.trainer is imported by now if a Trainer runs)

            # Before Accelerate records parameter names for the optimizer mapping; the
            # Parameter objects themselves are kept, so the optimizer stays valid.
            install_fp32_gate(model)
            note_restored_gates(model)
            _present_layer_classes_only(self.state.fsdp_plugin, model)
        result = original(self, *args)
        if model is not None and prepared_by_accelerate(model):
            _register_tensor_parallel_optimizers(model, result if isinstance(result, (tuple, list)) else (result,))
        return result

    return wrapper


def _register_tensor_parallel_optimizers(model: nn.Module, prepared: tuple[Any, ...]) -> None:
    """Under TP, checkpoints (Accelerate's save_state, the Trainer's) must see each
    optimizer's state in Transformers' layout, as the model's."""
    from ...parallel.tensor_parallel import register_optimizer_state_layout, tensor_parallel_group

    if tensor_parallel_group(model) is None:
        return
    for obj in prepared:
        optimizer = getattr(obj, "optimizer", obj)  # AcceleratedOptimizer wraps the torch one
        if isinstance(optimizer, torch.optim.Optimizer):
            register_optimizer_state_layout(model, optimizer)


def _present_layer_classes_only(plugin: Any, model: nn.Module) -> None:
    """Transformers lists `Qwen3_5VisionBlock` in `_no_split_modules` of the text-only
    model too; Accelerate before 1.16 then fails to find it in TRANSFORMER_BASED_WRAP. Our
    units do not use the wrap policy, so restrict the defaults to classes the model has
    (what Accelerate 1.16 does itself, so the plugin is left alone there)."""
    if getattr(plugin, "transformer_cls_names_to_wrap", None) is None and not accelerate_keeps_present_wrap_classes_only():
        present = {type(m).__name__ for m in model.modules()}
        names = [n for n in getattr(model, "_no_split_modules", None) or [] if n in present]
        if names:
            plugin.transformer_cls_names_to_wrap = names


def refuse_expert_parallelism(model: nn.Module, why: str) -> None:
    """QWEN35_ACCEL_EP > 1 where the plugin's FSDP2 path does not run: raise (on every rank: the
    settings are every rank's) rather than train every expert on every rank silently."""
    ep = PluginSettings.from_env(strict=True).parallel.ep
    if ep > 1:
        raise NotImplementedError(
            f"QWEN35_ACCEL_EP={ep} asks for expert parallelism, which qwen35_accel builds in its FSDP2 preparation; "
            f"here {why}, and {type(model).__name__} would hold every expert on every rank. Launch with an FSDP2 "
            "config without tp (accelerate_configs/cpu_fsdp2.yaml, fsdp2.yaml, fsdp2_cp2.yaml), or unset QWEN35_ACCEL_EP."
        )


def accelerate_keeps_present_wrap_classes_only() -> bool:
    """Whether Accelerate's default FSDP2 wrap classes are the model's `_no_split_modules` that it
    has (Accelerate >= 1.16); before, every listed class, so a listed class the model lacks stops
    the wrap ('Could not find the transformer layer class'). Names given in the config are used
    as given in both."""
    import accelerate
    from packaging.version import Version

    return Version(accelerate.__version__).release >= (1, 16)


def fsdp2_apply_ac(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(accelerator: Any, model: nn.Module) -> nn.Module:
        if is_plugin_fsdp2_module(model, accelerator):
            return model  # fsdp2_prepare_model -> PARALLELIZER.apply(activation_checkpointing=True)
        return original(accelerator, model)

    return wrapper


def _fsdp_mesh(accelerator: Any) -> Any:
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        return mesh
    from torch.distributed.device_mesh import init_device_mesh

    device_type = accelerator.device.type
    return init_device_mesh(device_type, (torch.distributed.get_world_size(),), mesh_dim_names=("dp_shard_cp",))


def prepare_qwen35_fsdp2(accelerator: Any, model: nn.Module, *, frozen: bool = False) -> nn.Module:
    """Accelerate's `fsdp2_prepare_model`, for a Qwen3.5 model: our parallelizer, its options
    translated from Accelerate's FSDP plugin and the plugin's settings.

    Follows Accelerate where it decides things for every model: trainable parameters are
    upcast to fp32 when `mixed_precision != "no"` (the gate holders are fp32 anyway), unless
    `frozen` (a reference model no optimizer holds: kept in its storage dtype, as TRL's own
    `prepare_fsdp` keeps it; it computes in the policy's dtype either way);
    with `cpu_ram_efficient_loading`, rank 0's weights are broadcast into the sharded
    model after sharding on the meta device.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from ...ops.kernels import run_summary
    from ...parallel.tensor_parallel import check_no_cpu_offload
    from ...parallelization import PARALLELIZER, mesh_dim_size

    model, compile_kwargs = take_over_compile(accelerator, model)
    if isinstance(model, FSDPModule) or isinstance(model.__dict__.get("_modules", {}).get("_orig_mod"), FSDPModule):
        return model  # prepared already (and compiled again by Accelerate: undone above without tp)
    settings = PluginSettings.from_env(strict=True)
    check_same_on_every_rank(settings)  # before any collective that a setting chooses
    plugin = accelerator.state.fsdp_plugin
    if accelerator.mixed_precision != "no" and not frozen:
        _upcast_trainable(model)
    mesh = _fsdp_mesh(accelerator)
    tp = mesh_dim_size(mesh, "tp")
    if tp > 1 and settings.parallel.vocab_parallel_lm_head:
        from ...model.detect import unwrap_qwen35
        from ..trl.fused_head import check_no_unwrapped_trl_head

        check_no_unwrapped_trl_head(unwrap_qwen35(model))
    check_no_cpu_offload(plugin.cpu_offload, tp)  # before the meta move below
    loading = _RamEfficientLoading.begin(model) if plugin.cpu_ram_efficient_loading else None
    ours = bool(plugin.activation_checkpointing)
    settings = settings.with_parallel(
        mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        offload_policy=plugin.cpu_offload,
        activation_checkpointing=ours,
        activation_offload=ours and bool(getattr(plugin, "activation_checkpointing_offload", False)),
        reshard_after_forward=plugin.reshard_after_forward,
        compile=compile_kwargs,
    )
    PARALLELIZER.apply(model, mesh, "dp_shard_cp", settings=settings, source="accelerate")
    if loading is not None:
        loading.finish(accelerator, model, tensor_parallel=tp > 1)
    if tp > 1:
        from ...parallel.tensor_parallel.clipping import check_one_gradient_mesh

        check_one_gradient_mesh(model)
    from ...parallel.prepared import prepared_state

    state = prepared_state(model)  # source "accelerate": the step hooks, evaluation and checkpoints act on it
    cp = mesh_dim_size(mesh, "cp")
    main_process_note(
        f"{type(getattr(model, '_orig_mod', model)).__name__.removeprefix('FSDP')} prepared by qwen35_accel: dtype-uniform FSDP2 units "
        f"(fp32 gate holders), mesh {dict(zip(mesh.mesh_dim_names or (), mesh.shape))}, cp={cp}, tp={tp}, "
        f"{experts_note(model)}"
        f"{mixed_precision_note(accelerator.mixed_precision, state.options.mp_policy)}, "
        f"activation checkpointing: {state.checkpointing}, loss: {loss_in_effect(model)}, "
        f"GatedDeltaNet kernels: {run_summary(accelerator.device)}{hub_kernels_note(model)}"
        f"{compile_note(state, compiled_whole=hasattr(model, '_orig_mod'))}"
    )
    return model


def _upcast_trainable(model: nn.Module) -> None:
    """Accelerate's rule under mixed precision: trainable parameters stored in fp32 (master weights)."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)


@dataclasses.dataclass
class _RamEfficientLoading:
    """Accelerate's `cpu_ram_efficient_loading`: the model moved to the meta device before sharding
    (`begin`), rank 0's weights broadcast into the sharded model after it (`finish`)."""

    state_dict: dict[str, torch.Tensor]
    non_persistent: dict[str, torch.Tensor]

    @classmethod
    def begin(cls, model: nn.Module) -> _RamEfficientLoading:
        from accelerate.utils.fsdp_utils import get_non_persistent_buffers

        state_dict = model.state_dict()
        buffer_fqns = get_non_persistent_buffers(model, recurse=True, fqns=True)
        non_persistent = {k: v.clone() for k, v in model.named_buffers() if k in buffer_fqns}
        model.to(torch.device("meta"))
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        return cls(state_dict, non_persistent)

    def finish(self, accelerator: Any, model: nn.Module, *, tensor_parallel: bool) -> None:
        from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
        from torch.distributed.fsdp import CPUOffloadPolicy

        if tensor_parallel:
            # Accelerate's loader copies full tensors into the per-head slices; ours
            # broadcasts rank 0's weights and each rank keeps its slice of its shard.
            from ...parallel.tensor_parallel import load_full_state_dict

            model.to_empty(device=accelerator.device)
            load_full_state_dict(model, self.state_dict if accelerator.is_main_process else None)
        else:
            offload = isinstance(accelerator.state.fsdp_plugin.cpu_offload, CPUOffloadPolicy)
            fsdp2_load_full_state_dict(accelerator, model, self.state_dict, cpu_offload=offload)
        for fqn, buffer in self.non_persistent.items():
            parent, _, name = fqn.rpartition(".")
            (model.get_submodule(parent) if parent else model).register_buffer(name, buffer.to(accelerator.device), persistent=False)
        if hasattr(model, "tie_weights"):
            model.tie_weights()


def fsdp2_prepare_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(accelerator: Any, model: nn.Module) -> nn.Module:
        if is_plugin_fsdp2_module(model, accelerator):
            return prepare_qwen35_fsdp2(accelerator, model)
        return original(accelerator, model)

    return wrapper


def prepare_tp(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any) -> Any:
        model = the_model(args)
        if model is not None and is_plugin_fsdp2_module(model, self):
            if not self.is_fsdp2:
                raise ValueError("tensor parallelism for Qwen3.5 runs with FSDP2 (fsdp_version: 2 in the config)")
            # Accelerate's TP path expects Transformers to have sharded the model at load
            # time; ours splits it by heads in PARALLELIZER.apply (mesh dim "tp") during
            # the FSDP2 preparation that follows.
            return args
        return original(self, *args)

    return wrapper


def prepare_cp(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any) -> Any:
        model = the_model(args)
        if model is not None and is_plugin_fsdp2_module(model, self):
            if not self.is_fsdp2:
                raise ValueError("context parallelism for Qwen3.5 needs FSDP2 (fsdp_version: 2 in the config)")
            # The CP layers are installed by PARALLELIZER.apply (mesh dim "cp") during the
            # FSDP2 preparation that follows; the step's context reads their mesh from the model's
            # state (`targets.accelerator_cp_mesh`).
            return args
        return original(self, *args)

    return wrapper


def note_restored_gates(model: nn.Module) -> None:
    """One line when `install_fp32_gate` took gate values back from the checkpoint (a bf16 load)."""
    from ...model.detect import unwrap_qwen35
    from ...model.state import find_state

    state = find_state(model)
    restored = state.restored_gates if state is not None else 0
    if restored:
        source = getattr(unwrap_qwen35(model), "name_or_path", None) or "its checkpoint"
        main_process_note(
            f"{restored} GatedDeltaNet gate tensors (A_log/dt_bias) were loaded below fp32; their fp32 values were read "
            f"back, bitwise, from {source}"
        )
