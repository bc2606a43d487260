"""The Accelerate plugin: a few version-guarded patch points into Accelerate.

For a dense Qwen3.5 model, Accelerate's FSDP2 preparation hands over to
`PARALLELIZER.apply` (dtype-uniform units, CP layers) with the settings of the
`FullyShardedDataParallelPlugin` and the accelerator's device mesh, and the per-step
context-parallel context shards the batch with our layout. Every other model takes
Accelerate's own path. On machines without accelerators an FSDP config runs FSDP2 over
gloo (for every model) instead of silently training N independent copies.

`install()` applies the patches (idempotent); `PATCH_POINTS` lists them; `status()`
reports what is active. Activation at interpreter start lives in
`qwen35_accel_autoload` (a torch entry point).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .cpu_backend import accelerator_state_init, main_process_note, prepare_backend
from .settings import PluginSettings

logger = logging.getLogger(__name__)

# The versions whose internals the patch points were written against and tested with.
TESTED_ACCELERATE = ">=1.15,<1.16"
TESTED_TRANSFORMERS = ">=5.24,<5.25"


@dataclasses.dataclass(frozen=True)
class PatchPoint:
    module: str
    attribute: str  # "Class.method" or a module-level name
    purpose: str


PATCH_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(
        "accelerate.state",
        "PartialState._prepare_backend",
        "no accelerator, WORLD_SIZE > 1 and an FSDP config: gloo backend, MULTI_CPU (stock: DistributedType.NO)",
    ),
    PatchPoint(
        "accelerate.state",
        "AcceleratorState.__init__",
        "then MULTI_CPU with an FSDP plugin becomes DistributedType.FSDP (stock ignores the plugin on CPU)",
    ),
    PatchPoint(
        "accelerate.accelerator",
        "Accelerator._prepare_tp",
        "dense Qwen3.5: Accelerate's load-time TP path is skipped; the parallelizer splits the model by heads",
    ),
    PatchPoint(
        "accelerate.accelerator",
        "Accelerator._prepare_cp",
        "dense Qwen3.5: no torch ring-attention hooks; the step's CP context becomes ours",
    ),
    PatchPoint(
        "accelerate.accelerator",
        "Accelerator._prepare_fsdp2",
        "dense Qwen3.5: fp32 gate holders installed before Accelerate records parameter names",
    ),
    PatchPoint(
        "accelerate.accelerator",
        "fsdp2_apply_ac",
        "dense Qwen3.5: skipped; the parallelizer checkpoints each decoder layer",
    ),
    PatchPoint(
        "accelerate.accelerator",
        "fsdp2_prepare_model",
        "dense Qwen3.5: PARALLELIZER.apply with the FSDP plugin's settings and the accelerator's mesh",
    ),
    PatchPoint(
        "accelerate.accelerator",
        "Accelerator.maybe_context_parallel",
        "dense Qwen3.5 under cp > 1: shards the step's buffers with qwen35_accel's layout",
    ),
    PatchPoint(
        "accelerate.accelerator",
        "Accelerator.clip_grad_norm_",
        "dense Qwen3.5 under tp > 1: the norm of the whole gradient (split parameters summed over the tp group)",
    ),
    PatchPoint(
        "accelerate.accelerator",
        "load_fsdp_model",
        "dense Qwen3.5 under tp > 1 with FULL_STATE_DICT (Accelerator.load_state): rank 0's file broadcast into the "
        "per-head slices (torch's full-state-dict loading copies full tensors into them)",
    ),
    PatchPoint(
        "transformers.trainer",
        "Trainer._load_from_checkpoint",
        "dense Qwen3.5 under tp > 1 with FULL_STATE_DICT (resume_from_checkpoint): as load_fsdp_model above (the "
        "Trainer holds its own reference to Accelerate's function)",
    ),
    PatchPoint(
        "transformers.trainer",
        "Trainer.save_model",
        "dense Qwen3.5 under FSDP2 with a sharded state dict type: the explicit save_model writes a Hugging Face "
        "checkpoint from the gathered weights (stock writes no weights at all)",
    ),
)

_ORIGINAL = "__qwen35_accel_original__"
_installed: dict[PatchPoint, Callable[..., Any]] = {}
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def accelerate_version_supported() -> tuple[bool, str]:
    """(whether the installed Accelerate is in `TESTED_ACCELERATE`, its version)."""
    import accelerate
    from packaging.specifiers import SpecifierSet

    version = accelerate.__version__
    return SpecifierSet(TESTED_ACCELERATE).contains(version, prereleases=True), version


def transformers_version_supported() -> tuple[bool, str]:
    """(whether the installed Transformers is in `TESTED_TRANSFORMERS`, its version)."""
    import importlib.metadata

    from packaging.specifiers import SpecifierSet

    version = importlib.metadata.version("transformers")
    return SpecifierSet(TESTED_TRANSFORMERS).contains(version, prereleases=True), version


def _is_dense_qwen35(model: Any) -> bool:
    from ..model.detect import is_dense_qwen35

    return isinstance(model, nn.Module) and is_dense_qwen35(model)


# ---------------------------------------------------------------- FSDP2 preparation


def _the_model(args: tuple[Any, ...]) -> nn.Module | None:
    models = [a for a in args if isinstance(a, nn.Module)]
    return models[0] if len(models) == 1 else None


def _prepare_fsdp2(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any) -> Any:
        model = _the_model(args)
        if model is not None and _is_dense_qwen35(model):
            from ..model.fp32_gate import install_fp32_gate

            install()  # the deferred points (transformers.trainer is imported by now if a Trainer runs)

            # Before Accelerate records parameter names for the optimizer mapping; the
            # Parameter objects themselves are kept, so the optimizer stays valid.
            install_fp32_gate(model)
            _present_layer_classes_only(self.state.fsdp_plugin, model)
        result = original(self, *args)
        if model is not None and getattr(model, "_qwen35_accel_prepared", False):
            _register_tensor_parallel_optimizers(model, result if isinstance(result, (tuple, list)) else (result,))
        return result

    return wrapper


def _register_tensor_parallel_optimizers(model: nn.Module, prepared: tuple[Any, ...]) -> None:
    """Under TP, checkpoints (Accelerate's save_state, the Trainer's) must see each
    optimizer's state in Transformers' layout, as the model's."""
    from ..parallel.tensor_parallel import register_optimizer_state_layout, tensor_parallel_group

    if tensor_parallel_group(model) is None:
        return
    for obj in prepared:
        optimizer = getattr(obj, "optimizer", obj)  # AcceleratedOptimizer wraps the torch one
        if isinstance(optimizer, torch.optim.Optimizer):
            register_optimizer_state_layout(model, optimizer)


def _present_layer_classes_only(plugin: Any, model: nn.Module) -> None:
    """Transformers lists `Qwen3_5VisionBlock` in `_no_split_modules` of the text-only
    model too; Accelerate's TRANSFORMER_BASED_WRAP then fails to find it. Our units do
    not use the wrap policy, so restrict the defaults to classes the model has."""
    if getattr(plugin, "transformer_cls_names_to_wrap", None) is None:
        present = {type(m).__name__ for m in model.modules()}
        names = [n for n in getattr(model, "_no_split_modules", None) or [] if n in present]
        if names:
            plugin.transformer_cls_names_to_wrap = names


def _fsdp2_apply_ac(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(accelerator: Any, model: nn.Module) -> nn.Module:
        if _is_dense_qwen35(model):
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


def prepare_qwen35_fsdp2(accelerator: Any, model: nn.Module) -> nn.Module:
    """Accelerate's `fsdp2_prepare_model`, for a dense Qwen3.5 model: our parallelizer.

    Follows Accelerate where it decides things for every model: trainable parameters are
    upcast to fp32 when `mixed_precision != "no"` (the gate holders are fp32 anyway);
    with `cpu_ram_efficient_loading`, rank 0's weights are broadcast into the sharded
    model after sharding on the meta device.
    """
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict, get_non_persistent_buffers
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy

    from ..parallelization import PARALLELIZER, mesh_dim_size

    if isinstance(model, FSDPModule):
        return model
    settings = PluginSettings.from_env()
    plugin = accelerator.state.fsdp_plugin
    if accelerator.mixed_precision != "no":
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)

    ram_efficient = bool(plugin.cpu_ram_efficient_loading)
    mesh = _fsdp_mesh(accelerator)
    offload = isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    tensor_parallel = mesh_dim_size(mesh, "tp") > 1
    if ram_efficient and tensor_parallel and offload:
        raise NotImplementedError(
            "fsdp_cpu_ram_efficient_loading with tensor parallelism and fsdp_offload_params is not supported for "
            "Qwen3.5; turn one of them off"
        )
    if ram_efficient:
        original_sd = model.state_dict()
        buffer_fqns = get_non_persistent_buffers(model, recurse=True, fqns=True)
        non_persistent = {k: v.clone() for k, v in model.named_buffers() if k in buffer_fqns}
        model = model.to(torch.device("meta"))
        if hasattr(model, "tie_weights"):
            model.tie_weights()

    PARALLELIZER.apply(
        model,
        mesh,
        "dp_shard_cp",
        mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        offload_policy=plugin.cpu_offload,
        activation_checkpointing=bool(plugin.activation_checkpointing),
        reshard_after_forward=plugin.reshard_after_forward,
        enable_fsdp2_prefetch=settings.fsdp2_prefetch,
        fsdp2_backward_prefetch_depth=settings.fsdp2_backward_prefetch_depth,
        fsdp2_forward_prefetch_depth=settings.fsdp2_forward_prefetch_depth,
        frozen_multimodal_sharding=settings.frozen_multimodal_sharding,  # type: ignore[arg-type]
        fp32_holder_units=settings.fp32_holder_units,  # type: ignore[arg-type]
        vocab_parallel_lm_head=settings.vocab_parallel_lm_head,
    )

    if ram_efficient:
        if tensor_parallel:
            # Accelerate's loader copies full tensors into the per-head slices; ours
            # broadcasts rank 0's weights and each rank keeps its slice of its shard.
            from ..parallel.tensor_parallel import load_full_state_dict

            model.to_empty(device=accelerator.device)
            load_full_state_dict(model, original_sd if accelerator.is_main_process else None)
        else:
            fsdp2_load_full_state_dict(accelerator, model, original_sd, cpu_offload=offload)
        for fqn, buffer in non_persistent.items():
            parent, _, name = fqn.rpartition(".")
            (model.get_submodule(parent) if parent else model).register_buffer(name, buffer.to(accelerator.device), persistent=False)
        if hasattr(model, "tie_weights"):
            model.tie_weights()

    model._qwen35_accel_prepared = True
    cp = mesh_dim_size(mesh, "cp")
    main_process_note(
        f"{type(model).__name__.removeprefix('FSDP')} prepared by qwen35_accel: dtype-uniform FSDP2 units "
        f"(fp32 gate holders), mesh {dict(zip(mesh.mesh_dim_names or (), mesh.shape))}, cp={cp}, tp={mesh_dim_size(mesh, 'tp')}, "
        f"activation checkpointing={bool(plugin.activation_checkpointing)}"
    )
    return model


def _fsdp2_prepare_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(accelerator: Any, model: nn.Module) -> nn.Module:
        if _is_dense_qwen35(model):
            return prepare_qwen35_fsdp2(accelerator, model)
        return original(accelerator, model)

    return wrapper


# ---------------------------------------------------------------- TP and CP


def _prepare_tp(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any) -> Any:
        model = _the_model(args)
        if model is not None and _is_dense_qwen35(model):
            if not self.is_fsdp2:
                raise ValueError("tensor parallelism for Qwen3.5 runs with FSDP2 (fsdp_version: 2 in the config)")
            # Accelerate's TP path expects Transformers to have sharded the model at load
            # time; ours splits it by heads in PARALLELIZER.apply (mesh dim "tp") during
            # the FSDP2 preparation that follows.
            return args
        return original(self, *args)

    return wrapper


def _prepare_cp(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any) -> Any:
        model = _the_model(args)
        if model is not None and _is_dense_qwen35(model):
            if not self.is_fsdp2:
                raise ValueError("context parallelism for Qwen3.5 needs FSDP2 (fsdp_version: 2 in the config)")
            # The CP layers are installed by PARALLELIZER.apply (mesh dim "cp") during the
            # FSDP2 preparation that follows; here only the per-step context changes.
            self._qwen35_cp_mesh = self.torch_device_mesh["cp"]
            return args
        return original(self, *args)

    return wrapper


def _maybe_context_parallel(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    @contextlib.contextmanager
    def wrapper(
        self: Any,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        cp_mesh = getattr(self, "_qwen35_cp_mesh", None)
        if cp_mesh is None:
            with original(self, buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers):
                yield
            return
        from ..context_parallel import sharded_buffers

        with sharded_buffers(buffers or [], buffer_seq_dims, no_restore_buffers, cp_mesh):
            yield

    return wrapper


def _clip_grad_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        from ..parallel.tensor_parallel import clip_grad_norm_, tensor_parallel_group

        models = [m for m in getattr(self, "_models", []) if getattr(m, "_qwen35_accel_prepared", False)]
        if len(models) == 1 and tensor_parallel_group(models[0]) is not None:
            parameters = list(parameters)
            if {id(p) for p in parameters} == {id(p) for p in models[0].parameters()}:
                return clip_grad_norm_(models[0], max_norm, norm_type)
            raise NotImplementedError(
                "clip_grad_norm_ on a subset of a tensor-parallel Qwen3.5 model's parameters is not supported; "
                "pass model.parameters()"
            )
        return original(self, parameters, max_norm, norm_type)

    return wrapper


def _is_tensor_parallel_qwen35(model: Any) -> bool:
    from ..parallel.tensor_parallel import tensor_parallel_group

    return getattr(model, "_qwen35_accel_prepared", False) and tensor_parallel_group(model) is not None


def _full_checkpoint_file(fsdp_plugin: Any, input_dir: str, model_index: int = 0) -> str | None:
    """The `pytorch_model_fsdp[_i].bin` Accelerate writes for FULL_STATE_DICT, if that is
    the plugin's type and `input_dir` holds it."""
    from accelerate.utils.constants import FSDP_MODEL_NAME
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    if fsdp_plugin is None or fsdp_plugin.state_dict_type != StateDictType.FULL_STATE_DICT:
        return None
    name = f"{FSDP_MODEL_NAME}.bin" if model_index == 0 else f"{FSDP_MODEL_NAME}_{model_index}.bin"
    path = os.path.join(input_dir, name)
    return path if os.path.isfile(path) else None


def _load_full_checkpoint_tensor_parallel(accelerator: Any, model: nn.Module, path: str) -> None:
    """Accelerate's FULL_STATE_DICT model loading for a tensor-parallel Qwen3.5 model.

    torch's `set_model_state_dict(full_state_dict=True)` copies the full tensors into the
    per-head slices (a shape error); here rank 0 reads the file, every tensor is broadcast
    and the model's load hooks keep each rank's slice. With SHARDED_STATE_DICT, Accelerate's
    own DCP loading already works: it goes through the model's and the optimizer's
    Transformers-layout state dicts, which slice on load.
    """
    from ..parallel.tensor_parallel import load_full_state_dict

    logger.info("Loading model from %s (tensor parallel)", path)
    # As Accelerate's load_fsdp_model does; its optimizer loading reads the same options.
    config = accelerator.state.fsdp_plugin.state_dict_config
    config.offload_to_cpu = config.rank0_only = accelerator.num_processes > 1
    state_dict = torch.load(path, weights_only=True, map_location="cpu") if accelerator.is_main_process else None
    load_full_state_dict(model, state_dict)


def _load_fsdp_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(fsdp_plugin: Any, accelerator: Any, model: nn.Module, input_dir: str, model_index: int = 0,
                *args: Any, **kwargs: Any) -> Any:
        if _is_tensor_parallel_qwen35(model):
            path = _full_checkpoint_file(fsdp_plugin, input_dir, model_index)
            if path is not None:
                return _load_full_checkpoint_tensor_parallel(accelerator, model, path)
        return original(fsdp_plugin, accelerator, model, input_dir, model_index, *args, **kwargs)

    return wrapper


def _trainer_load_from_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, resume_from_checkpoint: str, model: Any = None) -> Any:
        target = model if model is not None else self.model
        if _is_tensor_parallel_qwen35(target):
            plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            path = _full_checkpoint_file(plugin, resume_from_checkpoint)
            if path is not None:
                return _load_full_checkpoint_tensor_parallel(self.accelerator, target, path)
        return original(self, resume_from_checkpoint, model)

    return wrapper


def _trainer_save_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> None:
        accelerator = getattr(self, "accelerator", None)
        plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
        if (
            not _internal_call  # periodic checkpoints stay DCP-sharded (resume reads them)
            and plugin is not None
            and getattr(accelerator, "is_fsdp2", False)
            and "FULL_STATE_DICT" not in str(plugin.state_dict_type)
            and getattr(self.model, "_qwen35_accel_prepared", False)
        ):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state_dict = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            self._save(output_dir or self.args.output_dir, state_dict=state_dict)
            return
        original(self, output_dir, _internal_call)

    return wrapper


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "PartialState._prepare_backend": prepare_backend,
    "AcceleratorState.__init__": accelerator_state_init,
    "Accelerator._prepare_tp": _prepare_tp,
    "Accelerator._prepare_cp": _prepare_cp,
    "Accelerator._prepare_fsdp2": _prepare_fsdp2,
    "fsdp2_apply_ac": _fsdp2_apply_ac,
    "fsdp2_prepare_model": _fsdp2_prepare_model,
    "Accelerator.maybe_context_parallel": _maybe_context_parallel,
    "Accelerator.clip_grad_norm_": _clip_grad_norm,
    "load_fsdp_model": _load_fsdp_model,
    "Trainer._load_from_checkpoint": _trainer_load_from_checkpoint,
    "Trainer.save_model": _trainer_save_model,
}


def _owner_and_name(point: PatchPoint) -> tuple[Any, str]:
    import importlib

    owner: Any = importlib.import_module(point.module)
    *path, name = point.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _resolvable(point: PatchPoint) -> bool:
    """Whether the point's module is imported and its target already defined (a module
    that is still being imported, e.g. transformers.trainer importing Accelerate, is not)."""
    owner: Any = sys.modules.get(point.module)
    for part in point.attribute.split("."):
        if owner is None or not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return True


def _current(point: PatchPoint) -> Any:
    owner, name = _owner_and_name(point)
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def install() -> bool:
    """Apply every patch point (idempotent). Returns False, with one warning, when the
    installed Accelerate is outside `TESTED_ACCELERATE` (stock behaviour then)."""
    supported, version = accelerate_version_supported()
    if not supported:
        _warn_once(
            f"qwen35_accel: accelerate {version} is outside the tested range {TESTED_ACCELERATE}; the Accelerate plugin "
            "is not active (stock Accelerate behaviour). PARALLELIZER.apply still works directly."
        )
        return False
    transformers_ok, transformers_version = transformers_version_supported()
    for point in PATCH_POINTS:
        if point in _installed:
            continue
        if not point.module.startswith("accelerate") and not _resolvable(point):
            continue  # deferred: patched by a later install() once that module is fully imported
        if point.module.startswith("transformers") and not transformers_ok:
            _warn_once(
                f"qwen35_accel: transformers {transformers_version} is outside the tested range {TESTED_TRANSFORMERS}; "
                f"{point.module}.{point.attribute} is left unpatched."
            )
            continue
        owner, name = _owner_and_name(point)
        original = _current(point)
        if getattr(original, _ORIGINAL, None) is not None:  # patched by another copy of this module
            _installed[point] = getattr(original, _ORIGINAL)
            continue
        wrapper = _WRAPPERS[point.attribute](original)
        setattr(wrapper, _ORIGINAL, original)
        setattr(owner, name, wrapper)
        _installed[point] = original
    return True


def uninstall() -> None:
    """Restore Accelerate's originals (for tests and `QWEN35_ACCEL=0` comparisons)."""
    for point, original in list(_installed.items()):
        owner, name = _owner_and_name(point)
        setattr(owner, name, original)
        del _installed[point]


def status() -> dict[str, Any]:
    """Plugin state for `qwen35-accel env`: versions, activation, each patch point."""
    try:
        supported, version = accelerate_version_supported()
    except ImportError:
        supported, version = False, None
    points = []
    for point in PATCH_POINTS:
        active = False
        deferred = not point.module.startswith("accelerate") and not _resolvable(point)
        if version is not None and not deferred:  # status never imports anything
            with contextlib.suppress(Exception):
                active = getattr(_current(point), _ORIGINAL, None) is not None
        points.append(
            {"target": f"{point.module}.{point.attribute}", "active": active, "deferred": deferred, "purpose": point.purpose}
        )
    active = any(p["active"] for p in points)
    return {
        "accelerate": version,
        "tested_accelerate": TESTED_ACCELERATE,
        "supported": supported,
        "active": active,
        "why_not_active": None if active else _why_not_active(version, supported),
        "tested_transformers": TESTED_TRANSFORMERS,
        "patch_points": points,
    }


def _why_not_active(version: str | None, supported: bool) -> str:
    if version is None:
        return "accelerate is not installed"
    if not supported:
        return (
            f"accelerate {version} is outside the plugin's tested range {TESTED_ACCELERATE}: stock Accelerate behaviour "
            f"(install accelerate{TESTED_ACCELERATE}; PARALLELIZER.apply works without the plugin)"
        )
    try:
        enabled = PluginSettings.from_env().enabled
    except ValueError as error:
        return f"invalid settings: {error}"
    if not enabled:
        return "QWEN35_ACCEL=0 turns the automatic activation off (qwen35_accel.install() activates it explicitly)"
    return "not activated in this process (the torch entry point activates it once accelerate is imported)"
