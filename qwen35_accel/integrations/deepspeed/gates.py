"""The GatedDeltaNet gates under DeepSpeed ZeRO, kept out of DeepSpeed's engine and trained in fp32.

DeepSpeed casts every parameter of the model to bf16 in bf16 mode (one at a time, bypassing the
holder's dtype guard), builds each ZeRO optimizer in one dtype, and under ZeRO-3 partitions every
parameter it sees. The gates (`A_log`, `dt_bias`: 2 × value heads floats a layer) therefore live
outside the module tree DeepSpeed walks: each GatedDeltaNet keeps its fp32 holder as a plain
attribute (its forward reads it as before; `parameters()`, DeepSpeed's cast, its partitioning and
its optimizer never see it), the holder's state-dict hooks keep the Transformers keys in and out of
`state_dict()`, and `DeepSpeedGates` runs the rest of their life exactly as DeepSpeed runs the
others': gradients averaged over the data-parallel group at the accumulation boundary, their norm
inside DeepSpeed's global norm (so its clipping and the logged `grad_norm` cover them), the same clip
coefficient, an fp32 optimizer of the user's class and hyperparameters whose learning rate follows
DeepSpeed's groups (the scheduler's), stepped after DeepSpeed's.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...model.gate_holder import HOLDER_NAME, hidden_holder

# The gates' squared gradient norm during one DeepSpeed optimizer step, for the norm patch points.
GATE_SQUARED_NORM: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("qwen35_gate_sq_norm", default=None)

_TORCH_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


@dataclasses.dataclass(eq=False)
class DeepSpeedGates:
    """The gate holders of one model under a DeepSpeed engine, and their fp32 optimizer.

    `follows[i]`: the index of the DeepSpeed optimizer group whose learning rate gate group `i` takes
    (the group the gates were in before they left it)."""

    holders: list[nn.Module]
    optimizer: torch.optim.Optimizer
    follows: list[int]
    group: Any = None  # the data-parallel process group, set by `attach`

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for holder in self.holders for p in holder.parameters()]

    def attach(self, engine: Any) -> None:
        """After `deepspeed.initialize`: the holders on the engine's device, the same values on every
        rank (rank 0's of the engine's data-parallel group), its group kept for the reduction."""
        self.group = getattr(engine.optimizer, "dp_process_group", None)
        for holder in self.holders:
            holder.to(engine.device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            values = [param.data for param in self.params]
            flat = _flat(values)  # one collective for every gate of the model
            dist.broadcast(flat, source, group=self.group)
            _unflat(flat, values)

    def reduce(self) -> torch.Tensor:
        """At the accumulation boundary: each gate gradient averaged over the data-parallel group (as
        ZeRO averages the others); returns their squared norm (fp32 scalar)."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [param.grad for param in self.params]
        flat = _flat(grads)  # one collective for every gate of the model
        size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if size > 1:
            dist.all_reduce(flat, group=self.group)
            flat.div_(size)
            _unflat(flat, grads)
        return flat.float().pow(2).sum()

    def step(self, engine: Any) -> None:
        """After DeepSpeed's step: the gate gradients clipped by DeepSpeed's coefficient (its global norm
        now includes theirs), the learning rates DeepSpeed's groups hold, one fp32 step, gradients cleared."""
        clip = float(engine.gradient_clipping() or 0.0)
        norm = engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else 0.0
        if clip > 0.0 and math.isfinite(norm):
            coefficient = max((norm + 1e-6) / clip, 1.0)
            if coefficient > 1.0:
                for param in self.params:
                    param.grad.div_(coefficient)
        groups = engine.optimizer.param_groups
        for gate_group, index in zip(self.optimizer.param_groups, self.follows):
            gate_group["lr"] = groups[index]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`tensors` (one dtype and device) as one new 1-D tensor."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy `flat`'s consecutive pieces back into `tensors`."""
    for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(piece.view_as(tensor))


def hide_holders(model: nn.Module) -> list[nn.Module]:
    """Each GatedDeltaNet's fp32 holder moved out of the module tree into a plain attribute of the
    same name (its forward and state-dict hooks find it there, `hidden_holder`); returns every hidden
    holder of `model`, those hidden by an earlier call included."""
    holders = []
    for module in model.modules():
        if (holder := module._modules.pop(HOLDER_NAME, None)) is not None:
            module.__dict__[HOLDER_NAME] = holder
        if (holder := hidden_holder(module)) is not None:
            holders.append(holder)
    return holders


def show_holders(model: nn.Module) -> int:
    """`hide_holders` undone: each hidden holder back in the module tree; returns how many."""
    shown = 0
    for module in model.modules():
        if (holder := hidden_holder(module)) is not None:
            del module.__dict__[HOLDER_NAME]
            module._modules[HOLDER_NAME] = holder
            shown += 1
    return shown


def _groups_without(groups: list[dict[str, Any]], gates: dict[int, nn.Parameter]) -> tuple[list[dict[str, Any]], list[tuple[int, dict[str, Any]]]]:
    """`groups` with the gate parameters taken out, and (index, options with the holders' parameters) for
    each group that held some (`gates`: id of a parameter the groups may hold -> the holder's)."""
    kept, taken = [], []
    for index, group in enumerate(groups):
        params = list(group["params"])
        ours = [gates[id(p)] for p in params if id(p) in gates]
        kept.append({**group, "params": [p for p in params if id(p) not in gates]})
        if ours:
            taken.append((index, {**{k: v for k, v in group.items() if k != "params"}, "params": ours}))
    return kept, taken


def take_gates_out(
    holders: list[nn.Module], optimizer: Any, optimizer_config: dict[str, Any] | None,
    replaced: dict[int, nn.Parameter] | None = None, step_class: type | None = None,
) -> DeepSpeedGates:
    """Take the holders' parameters out of `optimizer` (a torch optimizer the script or the Trainer
    built, or Accelerate's `DummyOptim` for an optimizer in the DeepSpeed config, `optimizer_config`)
    and give them an fp32 optimizer of the same class and hyperparameters — of `step_class` instead, with
    the same groups, where the engine's parameters get another class's step (a torch optimizer that
    Accelerate rebuilds as DeepSpeed's CPU one under ZeRO-Offload). `replaced`: id of a parameter the optimizer may hold in a holder parameter's place (ZeRO-3's
    partitioned original) -> that holder parameter. Raises NotImplementedError for an optimizer it
    cannot mirror exactly."""
    gates = {id(p): p for holder in holders for p in holder.parameters()}
    gates.update(replaced or {})
    if optimizer is None:
        raise NotImplementedError(
            "DeepSpeed without an optimizer passed to prepare: qwen35_accel trains the GatedDeltaNet gates with an "
            "optimizer of the model's; pass the optimizer (or the Trainer's) to accelerator.prepare"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        kept, taken = _groups_without(optimizer.param_groups, gates)
        cls, defaults = step_class or type(optimizer), dict(optimizer.defaults)
        optimizer.param_groups[:] = kept
        for param in list(optimizer.state):
            if id(param) in gates:
                del optimizer.state[param]
    else:  # Accelerate's DummyOptim: DeepSpeed builds the optimizer its config names
        kind = str((optimizer_config or {}).get("type", "")).lower()
        if kind not in _TORCH_OPTIMIZERS:
            raise NotImplementedError(
                f"the DeepSpeed config's optimizer {kind or '(none)'!r}: qwen35_accel trains the GatedDeltaNet gates in "
                f"fp32 with the same optimizer outside DeepSpeed and mirrors {sorted(_TORCH_OPTIMIZERS)}; use one of "
                "those, or let the Trainer create the optimizer (no `optimizer` section in the config)"
            )
        cls = _TORCH_OPTIMIZERS[kind]
        defaults = {k: v for k, v in dict((optimizer_config or {}).get("params", {})).items() if k in ("lr", "betas", "eps", "weight_decay", "momentum")}
        defaults.setdefault("lr", optimizer.lr)
        params = optimizer.params
        groups = [dict(g) for g in params] if params and isinstance(params[0], dict) else [{"params": list(params)}]
        kept, taken = _groups_without(groups, gates)
        optimizer.params = kept if isinstance(params[0], dict) else kept[0]["params"]
    if not taken:
        raise ValueError(
            "the optimizer holds none of the GatedDeltaNet gates: they would not train. Pass it every parameter that "
            "trains; an optimizer built after the gates left the module tree (a DeepSpeed engine made of this model "
            "before, e.g. TRL's precompute_ref_log_probs under ZeRO-3, which builds one from the policy itself) does "
            "not see them: build the optimizer first, or precompute without ZeRO-3"
        )
    accepted = inspect.signature(cls.__init__).parameters
    gate_optimizer = cls([group for _, group in taken], **{k: v for k, v in defaults.items() if k in accepted and k != "params"})
    return DeepSpeedGates(holders=holders, optimizer=gate_optimizer, follows=[index for index, _ in taken])


def gates_state(gates: DeepSpeedGates) -> dict[str, Any]:
    """What a DeepSpeed checkpoint keeps of the gates: their fp32 values (CPU copies, in the holders'
    order) and their optimizer's state dict (None when they are frozen)."""
    return {
        "values": [param.detach().to("cpu", torch.float32).clone() for param in gates.params],
        "optimizer": gates.optimizer.state_dict() if gates.optimizer is not None else None,
    }


def load_gates_state(gates: DeepSpeedGates, saved: dict[str, Any], with_optimizer: bool = True) -> None:
    """`gates_state`'s dict back into `gates`: values copied into the holders, and (`with_optimizer`) the
    optimizer's state loaded.
    Raises ValueError naming the counts or shapes where the checkpoint is of another model."""
    params, values = gates.params, list(saved.get("values") or [])
    shapes = [tuple(p.shape) for p in params], [tuple(v.shape) for v in values]
    if shapes[0] != shapes[1]:
        raise ValueError(
            f"the DeepSpeed checkpoint's GatedDeltaNet gates ({len(values)} tensors, shapes {shapes[1][:4]}…) do not "
            f"fit this model's ({len(params)} tensors, shapes {shapes[0][:4]}…): a checkpoint of another model"
        )
    with torch.no_grad():
        for param, value in zip(params, values):
            param.copy_(value)
    if with_optimizer and gates.optimizer is not None and saved.get("optimizer") is not None:
        gates.optimizer.load_state_dict(saved["optimizer"])
