"""Accelerate's DeepSpeed preparation for a Qwen3.5-family model: fp32 gate holders installed (the
checkpoint's fp32 values read back after a bf16 load), kept out of DeepSpeed's engine and trained by
`integrations/deepspeed/gates.py`; the model's state dict carries them (fp32) for the Trainer's save.
Refused with the reason where that cannot be exact."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..notices import main_process_note
from ..targets import is_qwen35_module, the_model
from .preparation import note_restored_gates


def _refusal(config: dict[str, Any], parallelism: Any = None) -> str | None:
    """Why this DeepSpeed configuration (and Accelerate's `ParallelismConfig`, `parallelism`) cannot train
    the gates exactly, or None."""
    stage = int((config.get("zero_optimization") or {}).get("stage", 0) or 0)
    sp_size = int(getattr(parallelism, "sp_size", 1) or 1)
    if sp_size > 1 and getattr(parallelism, "sp_backend", None) == "deepspeed":
        return (f"DeepSpeed's sequence parallelism (Ulysses/ALST, sp_size {sp_size}): it shards the sequence around the "
                "attention interface, and each GatedDeltaNet would restart its recurrent state and conv on every rank "
                "(wrong gradients, even with sp_allow_recurrent_layers); for long sequences use the FSDP2 path's context "
                "parallelism (cp_size in the YAML's parallelism_config, e.g. accelerate_configs/fsdp2_cp2.yaml: "
                "the state passed between ranks, exact)")
    if (config.get("fp16") or {}).get("enabled") in (True, "true"):
        return ("fp16 under DeepSpeed: its dynamic loss scale skips overflowing steps the gates' optimizer would "
                "not know of; use bf16 (mixed_precision: bf16)")
    if stage == 0:
        return ("DeepSpeed without ZeRO (stage 0): qwen35_accel keeps the gates' norm and step beside ZeRO's "
                "optimizer; use zero_stage 1, 2 or 3, or DDP (the plugin holds the gates in fp32 there too)")
    return None


def _gather_partitioned_gates(model: nn.Module) -> dict[int, nn.Parameter]:
    """Under ZeRO-3's zero.Init (the Trainer's load): each GatedDeltaNet's partitioned `A_log`/`dt_bias`
    gathered and replaced by a whole parameter of the same values (collective over DeepSpeed's
    group: every rank, modules in the same order); returns id(partitioned original) -> replacement."""
    from ...model.gate_holder import GATE_PARAM_NAMES

    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        params = {name: p for name in GATE_PARAM_NAMES if (p := module._parameters.get(name)) is not None}
        if not any(hasattr(p, "ds_id") for p in params.values()):
            continue
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            for name, param in params.items():
                whole = nn.Parameter(param.data.detach().clone(), requires_grad=param.requires_grad)
                module._parameters[name] = whole
                replaced[id(param)] = whole
    return replaced


def keep_gates_outside(model: nn.Module) -> tuple[list[nn.Module], dict[int, nn.Parameter]]:
    """Before `deepspeed.initialize`: each GatedDeltaNet's gates in an fp32 holder (zero.Init-partitioned
    ones gathered first; the checkpoint's fp32 values read back after a bf16 load), the holders hidden
    from the module tree DeepSpeed walks (`hide_holders`); returns the holders (those hidden already
    included) and id(partitioned original) -> its replacement."""
    from ...model.fp32_gate import install_fp32_gate
    from ..deepspeed.gates import hide_holders

    replaced = _gather_partitioned_gates(model)
    install_fp32_gate(model)  # the checkpoint's fp32 values read back where the load rounded them
    note_restored_gates(model)
    return hide_holders(model), replaced


def _bnb_32bit(optimizer: Any, *names: str) -> bool:
    """Whether `optimizer` is a 32-bit bitsandbytes optimizer of one of the classes `names`."""
    cls = type(optimizer)
    if not cls.__module__.startswith("bitsandbytes") or cls.__name__ not in names:
        return False
    bits = getattr(optimizer, "optim_bits", None)
    if bits is None:  # bitsandbytes keeps it in `args` on some classes, as Accelerate reads it
        bits = getattr(getattr(optimizer, "args", None), "optim_bits", None)
    return bits == 32


def offload_class(optimizer: Any) -> type:
    """The class whose step equals the one Accelerate gives the engine's parameters in place of the torch
    optimizer `optimizer` under ZeRO-Offload (`map_pytorch_optim_to_deepspeed`, when the config offloads
    the optimizer and `zero_force_ds_cpu_optimizer` is on, its default), rebuilt from the same groups:
    DeepSpeedCPUAdam in AdamW mode for AdamW (torch's, or bitsandbytes' 32-bit), DeepSpeedCPUAdagrad for
    Adagrad, DeepSpeedCPULion for bitsandbytes' 32-bit Lion (its own class then), DeepSpeedCPUAdam in Adam
    mode (L2 decay) for any other (an SGD becomes Adam; DeepSpeedCPUAdam's defaults, torch Adam's, for what
    a group lacks)."""
    if isinstance(optimizer, torch.optim.AdamW) or _bnb_32bit(optimizer, "AdamW", "AdamW32bit"):
        return torch.optim.AdamW
    if isinstance(optimizer, torch.optim.Adagrad) or _bnb_32bit(optimizer, "Adagrad", "Adagrad32bit"):
        return torch.optim.Adagrad
    if _bnb_32bit(optimizer, "Lion", "Lion32bit"):
        return type(optimizer)
    return torch.optim.Adam


def replaces_optimizer_under_offload(config: dict[str, Any], optimizer: Any) -> bool:
    """Whether Accelerate's `_prepare_deepspeed` replaces `optimizer` (a torch optimizer) by DeepSpeed's CPU
    optimizer: the DeepSpeed `config` offloads the optimizer and leaves `zero_force_ds_cpu_optimizer` on."""
    offload = ((config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    return (isinstance(optimizer, torch.optim.Optimizer) and offload != "none"
            and bool(config.get("zero_force_ds_cpu_optimizer", True)))


def _take_gates_out(accelerator: Any, model: nn.Module, args: tuple[Any, ...]) -> Any:
    from ...model.detect import unwrap_qwen35
    from ...model.state import own_state
    from ..deepspeed.gates import DeepSpeedGates, take_gates_out

    config = accelerator.deepspeed_plugin.deepspeed_config
    why = _refusal(config, getattr(accelerator, "parallelism_config", None))
    if why is not None:
        raise NotImplementedError(f"{type(model).__name__} under DeepSpeed: {why}")
    holders, replaced = keep_gates_outside(model)
    optimizer = next((a for a in args if isinstance(a, torch.optim.Optimizer) or type(a).__name__ == "DummyOptim"), None)
    trainable = any(p.requires_grad for holder in holders for p in holder.parameters())
    if trainable and optimizer is not None:
        step_class = offload_class(optimizer) if replaces_optimizer_under_offload(config, optimizer) else None
        gates = take_gates_out(holders, optimizer, config.get("optimizer"), replaced, step_class)
        if step_class not in (None, type(optimizer)):
            main_process_note(
                f"under offload_optimizer Accelerate replaces the script's {type(optimizer).__name__} by DeepSpeed's CPU "
                f"optimizer ({type(gates.optimizer).__name__} steps, zero_force_ds_cpu_optimizer) for every parameter of "
                f"the engine; the GatedDeltaNet gates take the same steps (zero_force_ds_cpu_optimizer: false keeps "
                f"the {type(optimizer).__name__})"
            )
    else:  # frozen gates (LoRA), or no optimizer (evaluation, inference): kept in fp32, nothing to step
        gates = DeepSpeedGates(holders=holders, optimizer=None, follows=[])
    own_state(unwrap_qwen35(model)).deepspeed_gates = gates
    return gates


def prepare_deepspeed(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Accelerator._prepare_deepspeed` with a Qwen3.5-family model: its gates in fp32 holders outside
    the engine before `deepspeed.initialize`, attached to the engine after."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any) -> Any:
        model = the_model(args)
        if model is None or not is_qwen35_module(model):
            return original(self, *args)
        gates = _take_gates_out(self, model, args)
        result = original(self, *args)
        gates.attach(self.deepspeed_engine_wrapped.engine)
        stage = (self.deepspeed_plugin.deepspeed_config.get("zero_optimization") or {}).get("stage")
        main_process_note(
            f"{type(model).__name__} prepared by qwen35_accel for DeepSpeed ZeRO-{stage}: {len(gates.holders)} "
            "GatedDeltaNet gate holders (A_log/dt_bias) in fp32 outside the engine — fp32 in the forward, gradients "
            "averaged over the data-parallel group, inside DeepSpeed's norm and clipping, "
            + (f"stepped by an fp32 {type(gates.optimizer).__name__}" if gates.optimizer is not None else "frozen")
            + ", saved fp32"
        )
        return result

    return wrapper


def get_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Accelerator.get_state_dict` (the Trainer's save under DeepSpeed): the gates kept outside the engine
    added in fp32 under the Transformers keys (ZeRO-3's consolidated 16-bit state dict lacks them)."""

    @functools.wraps(original)
    def wrapper(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        from ...model.gate_holder import GATE_PARAM_NAMES, hidden_holder
        from ...model.state import find_state

        state_dict = original(self, model, *args, **kwargs)
        state = find_state(model)
        if not state_dict or state is None or state.deepspeed_gates is None:
            return state_dict
        for name, module in self.unwrap_model(model).named_modules():
            if (holder := hidden_holder(module)) is not None:
                for gate in GATE_PARAM_NAMES:
                    key = f"{name}.{gate}" if name else gate
                    state_dict[key] = getattr(holder, gate).detach().to("cpu", torch.float32).clone()
        return state_dict

    return wrapper
