"""Dtype-uniform FSDP2 units.

FSDP2 asserts that the trainable parameters of one unit share a storage dtype, and it
casts a whole unit to one `param_dtype` for compute. A decoder layer of Qwen3.5 holds
bf16 (or fp32-master) weights plus the fp32 gate holder, so one unit per layer cannot be
right. `fully_shard_by_dtype` splits a module into the fewest units that are each uniform
in (storage dtype, compute dtype).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

logger = logging.getLogger(__name__)

DtypeKey = tuple[torch.dtype, torch.dtype]  # (storage dtype, compute dtype)


def fp32_compute_policy(mp_policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The policy of an fp32-compute unit: params gathered and gradients reduced in fp32.

    `output_dtype` and `cast_forward_inputs` follow the user's policy (the holder returns
    fp32 whatever its input dtype).
    """
    return MixedPrecisionPolicy(
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        output_dtype=mp_policy.output_dtype,
        cast_forward_inputs=mp_policy.cast_forward_inputs,
    )


_RECORD = "_qwen35_fsdp_unit"  # attribute on each module of a unit made here


@dataclasses.dataclass(eq=False)
class UnitRecord:
    """One FSDP2 unit made by qwen35_accel, recorded when it was made.

    `modules` are the modules `fully_shard` was called on (several for the tail),
    `param_names[i]` the names, relative to `modules[i]`, of the parameters the unit
    manages, `mp_policy` its policy, `reshard_after_forward` the value it was made with
    (FSDP2's meaning; None: its default). The prefetch lists are what `set_layer_prefetch`
    set on the unit. Introspection (`describe_units`, `describe_prefetch`, `plan`) reads
    these instead of FSDP2's private state.
    """

    modules: list[nn.Module]
    param_names: list[list[str]]
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int | None = None
    forward_prefetch: list[UnitRecord] = dataclasses.field(default_factory=list)
    backward_prefetch: list[UnitRecord] = dataclasses.field(default_factory=list)

    def parameters(self) -> list[nn.Parameter]:
        """The unit's parameters as the modules hold them now (sharded DTensors once sharded)."""
        return [m.get_parameter(n) for m, names in zip(self.modules, self.param_names) for n in names]


def unit_record(module: nn.Module) -> UnitRecord | None:
    """The record of the unit `module` belongs to (made by qwen35_accel), or None."""
    return module.__dict__.get(_RECORD)


def shard_unit(
    modules: nn.Module | list[nn.Module],
    *,
    mp_policy: MixedPrecisionPolicy,
    ignored_params: set[nn.Parameter] | None = None,
    **kwargs: object,
) -> FSDPModule:
    """`fully_shard(modules, mp_policy=…, **kwargs)`, recording the unit on its modules."""
    mods = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    ignored = set(ignored_params or ())
    seen: set[int] = set()
    names: list[list[str]] = []
    for m in mods:  # what fully_shard will manage: not under a nested unit, not ignored, once
        own = []
        for name, p in _unmanaged_params(m, ignored):
            if id(p) not in seen:
                seen.add(id(p))
                own.append(name)
        names.append(own)
    if ignored:
        kwargs["ignored_params"] = ignored
    unit = fully_shard(modules, mp_policy=mp_policy, **kwargs)
    record = UnitRecord(mods, names, mp_policy, kwargs.get("reshard_after_forward"))  # type: ignore[arg-type]
    for m in mods:
        m.__dict__[_RECORD] = record
    return unit


def _is_fsdp(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _unmanaged_params(module: nn.Module, ignored: set[nn.Parameter]) -> Iterable[tuple[str, nn.Parameter]]:
    """Parameters `fully_shard(module)` would take: not under a nested FSDP unit, not ignored."""
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, m = stack.pop()
        for name, p in m.named_parameters(recurse=False):
            if p is not None and id(p) not in seen and p not in ignored:
                seen.add(id(p))
                yield prefix + name, p
        for name, child in m.named_children():
            if not _is_fsdp(child):
                stack.append((f"{prefix}{name}.", child))


def _trainable_keys(module: nn.Module, compute: torch.dtype | None, ignored: set[nn.Parameter]) -> dict[DtypeKey, int]:
    """Numel of the unmanaged trainable parameters of `module` per (storage, compute) dtype."""
    keys: dict[DtypeKey, int] = {}
    for _, p in _unmanaged_params(module, ignored):
        if p.requires_grad:
            key = (p.dtype, compute or p.dtype)
            keys[key] = keys.get(key, 0) + p.numel()
    return keys


def fully_shard_by_dtype(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    fp32_compute_module_names: Sequence[str] = ("_fp32_params",),
    ignored_params: set[nn.Parameter] | None = None,
) -> list[FSDPModule]:
    """Shard `module` into FSDP2 units that are each uniform in (storage, compute) dtype.

    Cases, by what the module's not-yet-sharded trainable parameters hold:
    1. Submodules named in `fp32_compute_module_names` (GatedDeltaNet's `_fp32_params`)
       become units of their own with `fp32_compute_policy(mp_policy)`, first; they stay
       gathered between forward and backward (`reshard_after_forward=False`).
    2. One dtype among the rest: `module` is one unit with `mp_policy`.
    3. Several: the dtype with the most elements stays with `module`; every largest
       subtree holding only another dtype becomes its own unit (same `mp_policy`, so a
       bf16 subtree in an fp32 layer computes as the policy says). A parameter of a
       minority dtype held directly by a module that also holds other dtypes cannot be
       isolated and raises ValueError naming it.
    Frozen parameters never split a unit (FSDP2 exempts them from the dtype rule).

    Args:
        module: not yet an FSDP module; nested units already made are respected.
        mesh: the 1-D shard mesh, or a 2-D (replicate, shard) mesh for HSDP.
        mp_policy: the user's policy for everything but fp32-compute holders.
        offload_policy: applied to every unit (None: no offload).
        reshard_after_forward: applied to every unit made here (FSDP2's meaning).
        fp32_compute_module_names: last names of submodules that must compute in fp32.
        ignored_params: parameters FSDP2 must leave alone (replicated on every rank).

    Returns: the units made: the outer unit first, then split subtrees, then holders.
    """
    ignored = set(ignored_params or ())
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload_policy or OffloadPolicy(),
                  ignored_params=ignored)
    holders: list[FSDPModule] = []
    for name, sub in module.named_modules():
        if sub is module or _is_fsdp(sub) or name.rsplit(".", 1)[-1] not in fp32_compute_module_names:
            continue
        if any(True for _ in _unmanaged_params(sub, ignored)):
            # Holders are tiny (2 x heads floats): keeping them gathered from forward to
            # backward saves one all-gather per layer for a few bytes of memory.
            holders.append(
                shard_unit(sub, mp_policy=fp32_compute_policy(mp_policy), **{**kwargs, "reshard_after_forward": False})
            )

    compute = mp_policy.param_dtype
    keys = _trainable_keys(module, compute, ignored)
    minority_units: list[FSDPModule] = []
    if len(keys) > 1:
        majority = max(keys, key=keys.get)
        minority_units = _split_minority(module, majority, compute, ignored, mp_policy, kwargs)
        logger.info(
            "%s: mixed trainable dtypes %s; kept %s in the unit, split %d subtree unit(s)",
            type(module).__name__,
            {f"{s}->{c}": n for (s, c), n in keys.items()},
            majority,
            len(minority_units),
        )
    outer = shard_unit(module, mp_policy=mp_policy, **kwargs)
    return [outer, *minority_units, *holders]


def _split_minority(
    module: nn.Module,
    majority: DtypeKey,
    compute: torch.dtype | None,
    ignored: set[nn.Parameter],
    mp_policy: MixedPrecisionPolicy,
    kwargs: dict,
) -> list[FSDPModule]:
    units: list[FSDPModule] = []
    for name, p in module.named_parameters(recurse=False):
        if p.requires_grad and p not in ignored and (p.dtype, compute or p.dtype) != majority:
            raise ValueError(
                f"{type(module).__name__}.{name} is a trainable {p.dtype} parameter held directly by a module whose "
                f"other trainable parameters are {majority[0]}; FSDP2 cannot put them in separate units. "
                f"Cast it to {majority[0]} or move it into a submodule of its own."
            )
    for child in module.children():
        if _is_fsdp(child):
            continue
        keys = _trainable_keys(child, compute, ignored)
        if not keys or set(keys) == {majority}:
            continue
        if len(keys) == 1:
            units.append(shard_unit(child, mp_policy=mp_policy, **kwargs))
        else:
            units.extend(_split_minority(child, majority, compute, ignored, mp_policy, kwargs))
    return units


def set_layer_prefetch(
    layer_units: Sequence[Sequence[FSDPModule]],
    *,
    forward_depth: int,
    backward_depth: int,
    before: FSDPModule | None = None,
    after: FSDPModule | None = None,
) -> None:
    """Explicit FSDP2 prefetch in decoder-layer order.

    `layer_units[i]` are the units of layer i, outer unit first. Entering layer i's
    forward gathers all units of layers i+1 … i+forward_depth; entering its backward
    gathers those of layers i-1 … i-backward_depth. `before` (the embedding's unit) runs
    before layer 0 in forward and `after` (the tail's) after the last layer: they join
    the chain at its ends, so layer 0 is gathered while the embedding runs, the tail
    while the last layer runs, and in backward the other way round. They may be the same
    unit (tied embeddings: the tail holds the embedding).
    """
    chain = [list(units) for units in layer_units]
    if before is not None:
        chain.insert(0, [before])
    if after is not None:
        chain.append([after])
    n = len(chain)
    for i, units in enumerate(chain):
        outer = units[0]
        record = unit_record(outer)
        if forward_depth > 0:
            ahead = [u for j in range(i + 1, min(n, i + 1 + forward_depth)) for u in chain[j] if u is not outer]
            if ahead:
                outer.set_modules_to_forward_prefetch(ahead)
                if record is not None:
                    record.forward_prefetch = [r for r in map(unit_record, ahead) if r is not None]
        if backward_depth > 0:
            behind = [u for j in range(i - 1, max(-1, i - 1 - backward_depth), -1) for u in chain[j] if u is not outer]
            if behind:
                outer.set_modules_to_backward_prefetch(behind)
                if record is not None:
                    record.backward_prefetch = [r for r in map(unit_record, behind) if r is not None]


def set_async_unshard_on_cpu(root: nn.Module, device_type: str) -> bool:
    """On CPU, make every unit's all-gathers asynchronous; returns whether it did.

    FSDP2 hides all-gathers behind compute by issuing them on separate accelerator
    streams. A CPU has no streams: with FSDP2's default (`async_op=False`) each
    all-gather, prefetches included, blocks this rank until every rank has joined it.
    With `async_op=True` a prefetch runs in the gloo worker threads while this thread
    computes, and the unit waits for it when its forward or backward needs the
    parameters. Accelerators keep FSDP2's stream-based default.
    """
    if device_type != "cpu":
        return False
    setter = getattr(root, "_set_unshard_async_op", None)  # FSDPModule; private in torch 2.13
    if setter is None:
        logger.warning(
            "qwen35_accel: this torch's FSDP2 has no _set_unshard_async_op; on CPU every all-gather, prefetches "
            "included, blocks until all ranks join it (slower, still correct)"
        )
        return False
    setter(True)
    return True


def fsdp_units(model: nn.Module) -> list[tuple[list[str], UnitRecord]]:
    """(module names, record) per FSDP2 unit qwen35_accel made in `model`, in module order.

    A unit over several modules (the tail) lists them all; units that manage no
    parameters (a root left empty) are skipped.
    """
    units: dict[int, tuple[list[str], UnitRecord]] = {}
    for name, module in model.named_modules():
        record = unit_record(module)
        if record is not None and any(record.param_names):
            units.setdefault(id(record), ([], record))[0].append(name)
    return list(units.values())


def describe_units(model: nn.Module) -> list[dict[str, object]]:
    """One row per FSDP2 unit of `model`, in module order, for logs and the demo.

    Row: `unit` (module path, "" for the root; a tail group joins its modules with "+"),
    `params` (element count), `trainable`, `storage` / `compute` dtype names.
    """
    rows = []
    for names, record in fsdp_units(model):
        params = record.parameters()
        storages = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))
        compute = record.mp_policy.param_dtype
        rows.append({
            "unit": "+".join(names),
            "params": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "storage": storages,
            "compute": str(compute).removeprefix("torch.") if compute is not None else storages,
        })
    return rows


def describe_prefetch(model: nn.Module) -> dict[str, dict[str, list[str]]]:
    """{"forward"/"backward": {unit: units it gathers ahead}} as set on `model`'s FSDP2
    units, in module order; units labelled as in `describe_units` (modules joined by "+")."""
    units = fsdp_units(model)
    label = {id(record): "+".join(names) for names, record in units}
    out: dict[str, dict[str, list[str]]] = {"forward": {}, "backward": {}}
    for names, record in units:
        for kind, targets in (("forward", record.forward_prefetch), ("backward", record.backward_prefetch)):
            labels = [label[id(t)] for t in targets if id(t) in label]
            if labels:
                out[kind]["+".join(names)] = labels
    return out
