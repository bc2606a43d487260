"""Several dense Qwen3.5 models per run: a policy and a frozen reference (DPO, GRPO, distillation).

Stock Accelerate prepares one model per FSDP2 `prepare` call (it raises "Only one model is
supported when using FSDP2"), and TRL wraps its reference model itself (`prepare_fsdp`: one
`fully_shard` on the whole model, so no per-layer units, the gate parameters gathered in the
compute dtype, no CP/TP layers). Here every extra dense Qwen3.5 model is prepared as the
policy is (`prepare_qwen35_fsdp2`: our units, fp32 gate holders, the accelerator's mesh with
its cp/tp layers); the policy (the model whose parameters the optimizer holds) takes the
ordinary path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..parallel.mesh import mesh_dim_size
from .targets import is_dense_qwen35_module


def accelerator_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Accelerator.__init__`: then apply the deferred patch points whose modules are imported
    by now (a Trainer subclass such as TRL's `DPOTrainer` prepares its reference model right
    after creating the accelerator, before any `prepare` call).

    Before the original runs, the one parallelism layout Accelerate refuses with advice that
    contradicts itself (replicate-only data parallelism with cp or tp > 1) is refused here with
    the layout that works. An error the original raises by itself is Accelerate's: it passes
    through this frame unchanged but for a note saying so (Python cannot drop a caller's
    frame from a traceback)."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        refusal = replicate_only_refusal(kwargs.get("parallelism_config"))
        if refusal is not None:
            raise refusal
        try:
            original(self, *args, **kwargs)
        except Exception as error:
            _note_if_not_ours(error, "Accelerate's own Accelerator.__init__")
            raise
        from .patches import install

        install()

    return wrapper


def replicate_only_refusal(config: Any = None) -> ValueError | None:
    """The error for `dp_replicate_size > 1` with `dp_shard_size == 1` and cp or tp > 1, or None.

    Accelerate refuses that layout in `ParallelismConfig` with advice that contradicts itself
    (it asks for `dp_replicate_size == 1` for HSDP). `config`: the `ParallelismConfig` given to
    the Accelerator, or None for the one Accelerate builds from `PARALLELISM_CONFIG_*`
    (what `accelerate launch` sets from the YAML's `parallelism_config`).
    """
    if config is not None:
        return None  # built by the caller, so Accelerate's check already ran (outside our frames)

    def size(name: str) -> int:
        try:
            return int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))
        except ValueError:
            return 1  # Accelerate reports it

    replicate, shard, cp, tp = size("dp_replicate"), size("dp_shard"), size("cp"), size("tp")
    if not (replicate > 1 and shard == 1 and (cp > 1 or tp > 1)):
        return None
    world = replicate * cp * tp
    layouts = [f"dp_replicate_size: 1, dp_shard_size: {replicate} (FSDP2 over the data-parallel ranks)"]
    if replicate % 2 == 0 and replicate > 2:
        layouts.append(f"dp_replicate_size: {replicate // 2}, dp_shard_size: 2 (HSDP)")
    if cp % 2 == 0:  # keep the replicas (e.g. one per node) and give dp_shard half the cp ranks
        layouts.append(f"dp_replicate_size: {replicate}, dp_shard_size: 2, cp_size: {cp // 2} (HSDP)")
    elif tp % 2 == 0:
        layouts.append(f"dp_replicate_size: {replicate}, dp_shard_size: 2, tp_size: {tp // 2} (HSDP)")
    return ValueError(
        f"parallelism_config has dp_replicate_size={replicate}, dp_shard_size=1, cp_size={cp}, tp_size={tp}: Accelerate "
        "composes cp and tp only with sharded data parallelism (dp_shard_size > 1) and refuses this layout. Layouts "
        f"that work on the same {world} processes: " + "; or ".join(layouts) + ". See docs/multi_node.md. (Refused by "
        "qwen35_accel before Accelerate's own check, whose advice contradicts itself.)"
    )


def _note_if_not_ours(error: BaseException, where: str) -> None:
    """Add a note to an error raised below a wrapper by the wrapped original alone (no frame of
    qwen35_accel between the wrapper and the raise), so a reader does not blame the plugin."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None  # below this wrapper
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package + os.sep):
            return  # a patch point of ours ran below: not only Accelerate's
        tb = tb.tb_next
    error.add_note(f"(raised by {where}; the qwen35_accel wrapper above it in the traceback only called it)")


def prepare_extra_model(accelerator: Any, model: nn.Module, *, register: bool) -> nn.Module:
    """A dense Qwen3.5 model that no optimizer holds (a frozen reference), prepared as
    `Accelerator.prepare` prepares the policy: fp32 gate holders, then our FSDP2 units (and
    CP/TP layers) on the accelerator's mesh. `register`: added to the accelerator's prepared
    models, as `Accelerator.prepare` does (TRL's `prepare_fsdp` does not)."""
    from ..model.fp32_gate import install_fp32_gate
    from .preparation import prepare_qwen35_fsdp2

    install_fp32_gate(model)
    model = prepare_qwen35_fsdp2(accelerator, model)
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None and mesh_dim_size(mesh, "cp") > 1:  # as `prepare_cp` does for the policy
        accelerator._qwen35_cp_mesh = mesh["cp"]
    if register and model not in accelerator._models:
        accelerator._models.append(model)
        model._is_accelerate_prepared = True
    return model


def prepare(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Accelerator.prepare` with several dense Qwen3.5 models under FSDP2, or one without an
    optimizer (evaluation only; stock FSDP2 refuses a model without its optimizer): the ones
    no optimizer among the arguments holds are prepared by `prepare_extra_model`, the rest
    by the original (one model with its optimizer); results come back in argument order."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, device_placement: Any = None) -> Any:
        indices = [i for i, a in enumerate(args) if isinstance(a, nn.Module)]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        if (
            not indices
            or (len(indices) == 1 and optimizers)  # the ordinary case
            or not getattr(self, "is_fsdp2", False)
            or not all(is_dense_qwen35_module(args[i]) for i in indices)
        ):
            return original(self, *args, device_placement=device_placement)
        optimized = {id(p) for a in optimizers for g in a.param_groups for p in g["params"]}
        policies = [i for i in indices if any(id(p) in optimized for p in args[i].parameters())]
        if len(policies) > 1:
            raise ValueError(
                f"{len(policies)} of the {len(indices)} models passed to prepare have parameters in an optimizer; under "
                "FSDP2 one model trains per prepare call (prepare each trained model with its optimizer separately)"
            )
        extras = [i for i in indices if i not in policies]
        result = list(args)
        for i in extras:
            result[i] = prepare_extra_model(self, args[i], register=True)
        rest = [i for i in range(len(args)) if i not in extras]
        if rest:
            placement = [device_placement[i] for i in rest] if device_placement is not None else None
            prepared = original(self, *(args[i] for i in rest), device_placement=placement)
            prepared = prepared if len(rest) > 1 else (prepared,)
            for i, obj in zip(rest, prepared):
                result[i] = obj
        return tuple(result) if len(result) > 1 else result[0]

    return wrapper


# TRL trainers that compute log-probabilities of whole sequences from the logits they receive
# (under CP: this rank's chunks), so they cannot run under our context parallelism.
TRL_LOGPROB_TRAINERS = ("DPOTrainer", "GRPOTrainer", "RLOOTrainer", "KTOTrainer")
# TRL trainers that sample completions per process: each process gets its own seed
# (`set_seed(..., device_specific=True)`) and its slice of the batch by process index, so
# the ranks of a tp group would generate, and then train on, different sequences.
TRL_SAMPLING_TRAINERS = ("GRPOTrainer", "RLOOTrainer")


def trl_trainer(trainer: Any, names: tuple[str, ...]) -> str | None:
    """The name of the TRL class among `names` that `trainer` is (or derives from), else None."""
    for cls in type(trainer).__mro__:
        if cls.__module__.startswith("trl.") and cls.__name__ in names:
            return cls.__name__
    return None


def trl_under_tp_error(trainer: str, tp_size: int) -> NotImplementedError:
    return NotImplementedError(
        f"TRL's {trainer} under tensor parallelism (tp_size={tp_size}) is not supported for Qwen3.5 by qwen35_accel: "
        "TRL seeds every process differently for sampling and slices each step's completions by process index, so "
        "the tp ranks of a group, which must see the same tokens, would generate and train on different "
        f"completions. Run {trainer} with tp_size 1 (FSDP2 works; the reference model gets qwen35_accel's units)."
    )


def trl_under_cp_error(trainer: str, cp_size: int) -> NotImplementedError:
    return NotImplementedError(
        f"TRL's {trainer} under context parallelism (cp_size={cp_size}) is not supported for Qwen3.5 by "
        "qwen35_accel: TRL computes log-probabilities from the logits it receives, which under CP are this rank's "
        f"sequence chunks. Run {trainer} with cp_size 1 (FSDP2 and tensor parallelism work)."
    )


def trl_prepare_fsdp(trainer: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper of TRL's `prepare_fsdp(model, accelerator)` as `trainer`'s module imports it
    (its reference model): for a dense Qwen3.5 model under FSDP2, `prepare_extra_model`, in
    eval mode, as TRL leaves it. Under context parallelism refused: these trainers compute
    per-sequence (or per-token) log-probabilities from the logits they receive, which are
    this rank's sequence chunks, and GRPO/RLOO generate, which CP cannot."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(model: nn.Module, accelerator: Any) -> nn.Module:
            plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
            if is_dense_qwen35_module(model) and plugin is not None and plugin.fsdp_version == 2 and not getattr(
                model, "_qwen35_accel_prepared", False
            ):
                parallelism = getattr(accelerator, "parallelism_config", None)
                if parallelism is not None and parallelism.cp_enabled:
                    raise trl_under_cp_error(trainer, parallelism.cp_size)
                model = prepare_extra_model(accelerator, model, register=False)
                model.eval()
                return model
            return original(model, accelerator)

        return wrapper

    return wrap
