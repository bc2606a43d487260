"""The model a launch would build, laid out as the parallelizer lays it out: on the meta
device, the FSDP2 units with their bytes per rank, grouped by decoder layer, and where FSDP2
holds a VLM's vision tower."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from .config import PlanError, dtype_bytes
from .step_inputs import Precision


def meta_model(config: Any, vision_tower: str, mixed_precision: str) -> tuple[Any, Any, Any, Precision]:
    """(the model a run would load, on the meta device; its `Qwen35Parts`; the FSDP2
    mixed-precision policy; its `Precision`): the VLM (`AutoModelForImageTextToText`) for a
    config with a vision tower unless `vision_tower` is "none", frozen if "frozen", in the
    config's dtype; under `mixed_precision` bf16/fp16 its trainable parameters upcast to fp32
    as Accelerate does (frozen ones stay in their storage dtype)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from ..model.detect import FAMILIES, qwen35_parts

    storage = getattr(config, "dtype", None) or torch.float32
    if isinstance(storage, str):
        storage = getattr(torch, storage)
    auto = AutoModelForCausalLM if vision_tower == "none" else AutoModelForImageTextToText
    with torch.device("meta"):
        net = auto.from_config(config, dtype=storage)
    parts = qwen35_parts(net, families=FAMILIES)
    if vision_tower == "frozen":
        parts.vision_model.requires_grad_(False)  # type: ignore[union-attr]
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    if compute is not None:  # as Accelerate: fp32 master weights, compute in the policy's dtype
        for p in net.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute is not None else None)
    precision = Precision(storage=dtype_bytes(storage), param=4 if compute is not None else dtype_bytes(storage),
                          compute=dtype_bytes(compute or storage))
    return net, parts, policy, precision


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """A process group of `world` ranks whose collectives are no-ops ("fake"), for laying a
    model out as `world` processes would, destroyed on exit; a group already there (a plan
    made inside a distributed job) is used if it has `world` ranks, else PlanError."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise PlanError(f"the YAML describes {world} processes, but this process is rank {dist.get_rank()} of a "
                            f"process group of {dist.get_world_size()}; make the plan outside that job (qwen35-accel plan)")
        yield
        return
    dist.init_process_group("fake", rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def parallelize(net: Any, sizes: dict[str, int], policy: Any, activation_checkpointing: bool,
                reshard_after_forward: Any, settings: Any) -> str | None:
    """`PARALLELIZER.apply` on `net` over the world's process group (`fake_world`), as the
    plugin would call it (the same QWEN35_ACCEL_* settings); the reason tensor parallelism
    cannot be applied (NotImplementedError), or None."""
    from accelerate.parallelism_config import ParallelismConfig

    from ..parallel.mesh import ParallelDims
    from ..parallelization import PARALLELIZER

    config = ParallelismConfig(
        dp_replicate_size=sizes["dp_replicate"], dp_shard_size=sizes["dp_shard"], cp_size=sizes["cp"], tp_size=sizes["tp"]
    )
    try:
        chosen = settings.with_parallel(  # every setting the plugin passes (prefetch, units, tiled loss, ep)
            mp_policy=policy, activation_checkpointing=activation_checkpointing,
            reshard_after_forward=reshard_after_forward,
        )
        PARALLELIZER.apply(net, ParallelDims.from_parallelism_config(config, "cpu").mesh, settings=chosen)
    except NotImplementedError as exc:
        return str(exc)
    except ValueError as exc:  # a configuration the model cannot take (e.g. tp not dividing the heads)
        raise PlanError(str(exc)) from None
    return None


def _shard_rows(rows: int, shards: int) -> list[int]:
    """Rows per rank of FSDP2's dim-0 sharding (torch.chunk sizes, trailing ranks may hold 0)."""
    chunk = math.ceil(rows / shards) if rows else 0
    return [max(0, min(chunk, rows - r * chunk)) for r in range(shards)]


def unit_bytes(params: list[Any], shards: int, tp_sliced: set[int], tp: int) -> tuple[list[int], int]:
    """(bytes on each rank of one FSDP shard group, distinct bytes over the whole world)."""
    per_rank = [0] * shards
    distinct = 0
    for param in params:
        shape = param.shape
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        for r, rows in enumerate(_shard_rows(shape[0], shards)):
            per_rank[r] += rows * row * param.element_size()
        # A TP-sliced parameter holds 1/tp of the model's tensor on each tp rank.
        distinct += math.prod(shape) * param.element_size() * (tp if id(param) in tp_sliced else 1)
    return per_rank, distinct


def unit_rows(net: Any, units: list[tuple[list[str], Any]], shards: int, tp: int) -> list[dict[str, Any]]:
    """One row per FSDP2 unit of `units` (`fsdp_units(net)`): modules, storage and compute
    dtype, parameters, bytes on the most loaded rank and over all ranks."""
    from ..parallel.fsdp import describe_units
    from ..parallel.tensor_parallel import tensor_parallel_sliced

    tp_sliced = tensor_parallel_sliced(net)
    rows = []
    for (names, record), row in zip(units, describe_units(net)):
        per_rank, distinct = unit_bytes(record.parameters(), shards, tp_sliced, tp)
        rows.append({
            "modules": names,
            "storage": row["storage"],
            "compute": row["compute"],
            "params": row["params"],
            "bytes_per_rank_max": max(per_rank),
            "bytes_all_ranks": distinct,
        })
    return rows


def held_expert_rows(net: Any, tp: int, compute: Any) -> list[dict[str, Any]]:
    """One row per experts module held by ep × tp (`expert_parallel.over_tensor_parallel`: no FSDP2 unit; each
    rank holds its whole experts, listed with the units so the bytes add up). `compute`: the
    policy's param dtype (None: the storage's)."""
    from ..parallel.expert_parallel.over_tensor_parallel import HELD_ATTR

    rows = []
    for name, module in net.named_modules():
        if not hasattr(module, HELD_ATTR):
            continue
        params = list(module.parameters())
        storage = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))
        rows.append({
            "modules": [f"{name} (held: ep x tp)"],
            "storage": storage,
            "compute": str(compute).removeprefix("torch.") if compute is not None else storage,
            "params": sum(p.to_local().numel() for p in params),
            "bytes_per_rank_max": sum(p.to_local().numel() * p.element_size() for p in params),
            "bytes_all_ranks": sum(p.numel() * p.element_size() * tp for p in params),
        })
    return rows


def reference_unit_bytes(rows: list[dict[str, Any]], storage: int) -> int:
    """Bytes per rank (max) of a frozen reference laid out as the policy's `unit_rows`: each
    unit in the checkpoint's dtype (`storage` bytes per element; the plugin keeps a frozen
    model's dtype), the fp32 gate holders fp32 in both."""
    from ..model.fp32_gate import HOLDER_NAME

    def held(u: dict[str, Any]) -> int:
        if all(HOLDER_NAME in m.split(".") for m in u["modules"]):
            return u["bytes_per_rank_max"]
        return u["bytes_per_rank_max"] * storage // dtype_bytes(u["storage"])

    return sum(held(u) for u in rows)


def in_vision(module: str) -> bool:
    return "visual" in module.split(".")


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    if "layers" in parts and parts.index("layers") + 1 < len(parts) and "visual" not in parts:
        return int(parts[parts.index("layers") + 1])
    return None


Rows = list[dict[str, Any]]


def by_layer(rows: Rows, layer_types: tuple[str, ...]) -> tuple[Rows, Rows, Rows]:
    """`unit_rows` split into (decoder layers: {"layer", "type", "units"} in order, the
    vision tower's own units, the other units: embedding, tail, root, units over several layers)."""
    layers: Rows = []
    vision: Rows = []
    other: Rows = []
    for unit in rows:
        if unit["modules"] and all(in_vision(m) for m in unit["modules"]):
            vision.append(unit)
            continue
        owners = {_layer_of(m) for m in unit["modules"]}
        index = owners.pop() if len(owners) == 1 else None  # a unit over several layers is listed apart
        if index is None:
            other.append(unit)
            continue
        while len(layers) <= index:
            layers.append({"layer": len(layers), "type": layer_types[len(layers)], "units": []})
        layers[index]["units"].append(unit)
    return layers, vision, other


def vision_report(visual: Any, units: list[tuple[list[str], Any]], rows: list[dict[str, Any]], shards: int,
                  sharding: str) -> dict[str, Any]:
    """Where FSDP2 holds a VLM's vision tower `visual` and its bytes on the most loaded rank:
    `rows`, the tower's own units (`unit_rows` rows); the parameters the root unit holds
    (`units`: `fsdp_units` of the model); those left unsharded (replicated on every rank)."""
    params = list(visual.parameters())
    in_units = {id(p) for names, record in units if not all(map(in_vision, names)) for p in record.parameters()}
    in_own_units = {id(p) for names, record in units if all(map(in_vision, names)) for p in record.parameters()}
    root_held = [p for p in params if id(p) in in_units]
    replicated = [p for p in params if id(p) not in in_units and id(p) not in in_own_units]
    root_bytes = max(unit_bytes(root_held, shards, set(), 1)[0]) if root_held else 0
    replicated_bytes = sum(p.numel() * p.element_size() for p in replicated)
    return {
        "trainable": any(p.requires_grad for p in params),
        "frozen_multimodal_sharding": sharding,
        "layout": "units" if rows else ("replicate" if replicated else "root"),
        "parameters": sum(p.numel() for p in params),
        "units": rows,
        "unit_count": len(rows),
        "bytes_per_unit_max": max((u["bytes_per_rank_max"] for u in rows), default=0),
        "root_parameters": sum(p.numel() for p in root_held),
        "root_bytes_per_rank": root_bytes,
        "replicated_parameters": sum(p.numel() for p in replicated),
        "replicated_bytes_per_rank": replicated_bytes,
        "bytes_per_rank": sum(u["bytes_per_rank_max"] for u in rows) + root_bytes + replicated_bytes,
    }
