"""`qwen35-accel plan`: what a launch will do, without GPUs or weights.

`plan` builds the model on the meta device and runs the real parallelizer in one
process over a fake process group of the config's world size (torch's "fake" backend:
collectives are no-ops, shapes and placements are real), then reports the mesh, every
FSDP2 unit per decoder layer (modules, storage/compute dtype, parameters, bytes per
rank), a VLM's vision tower (its units, or where else FSDP2 holds it, and its bytes per
rank) and the context-parallel layout with its per-layer communication.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class PlanError(Exception):
    """A configuration `plan` cannot lay out; the message names what to change."""


def _load_yaml(path: str) -> Any:
    from accelerate.commands.config.config_args import load_config_from_file

    if not os.path.isfile(path):
        raise PlanError(f"no such config file: {path}")
    return load_config_from_file(path)


def _sizes(cluster: Any) -> dict[str, int]:
    raw = cluster.parallelism_config or {}
    world = int(cluster.num_processes or 1)

    def size(name: str) -> int:
        return int(raw.get(f"parallelism_config_{name}_size") or 1)

    sizes = {"dp_replicate": size("dp_replicate"), "cp": size("cp"), "tp": size("tp")}
    shard = raw.get("parallelism_config_dp_shard_size")
    rest = sizes["dp_replicate"] * sizes["cp"] * sizes["tp"]
    sizes["dp_shard"] = int(shard) if shard else max(1, world // rest)
    total = rest * sizes["dp_shard"]
    if total != world:
        raise PlanError(
            f"dp_replicate {sizes['dp_replicate']} x dp_shard {sizes['dp_shard']} x cp {sizes['cp']} "
            f"x tp {sizes['tp']} = {total} does not match num_processes {world}; change num_processes or the "
            "parallelism_config sizes so that they agree"
        )
    return {"world": world, **sizes}


VISION_TOWER_CHOICES = ("trainable", "frozen", "none")


def _model_config(model: str) -> Any:
    if model == "tiny":
        from .model.tiny import tiny_text_config

        return tiny_text_config()
    if model == "tiny-vlm":
        from .model.tiny import tiny_vlm_config

        return tiny_vlm_config()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise PlanError(f"--model {model!r}: {str(error).splitlines()[0]}; pass a model directory or 'tiny'") from None


def _shard_rows(rows: int, shards: int) -> list[int]:
    """Rows per rank of FSDP2's dim-0 sharding (torch.chunk sizes, trailing ranks may hold 0)."""
    chunk = math.ceil(rows / shards) if rows else 0
    return [max(0, min(chunk, rows - r * chunk)) for r in range(shards)]


def _unit_bytes(params: list[Any], shards: int, tp_sliced: set[int], tp: int) -> tuple[list[int], int]:
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


def _units(model: Any, shards: int, tp: int = 1) -> list[dict[str, Any]]:
    from .parallel.fsdp import describe_units, fsdp_units
    from .parallel.tensor_parallel import tensor_parallel_sliced

    tp_sliced = tensor_parallel_sliced(model)
    rows = []
    for (names, record), row in zip(fsdp_units(model), describe_units(model)):
        per_rank, distinct = _unit_bytes(record.parameters(), shards, tp_sliced, tp)
        rows.append({
            "modules": names,
            "storage": row["storage"],
            "compute": row["compute"],
            "params": row["params"],
            "bytes_per_rank_max": max(per_rank),
            "bytes_all_ranks": distinct,
        })
    return rows


def _cp_comm(
    text_config: Any, cp: int, tp: int, seq_len: int, compute_bytes: int, exchange: str, backend: str
) -> dict[str, Any]:
    """Bytes each rank sends per layer and sequence, forward (backward sends as much back),
    by `benchmarks/cp_comm.py`'s convention: a ring all-gather sends (cp − 1) × its input.
    GatedDeltaNet heads and attention K/V heads are split over tp (head parallel)."""
    from .parallel.context_parallel.state_exchange import exchange_bytes, resolve_exchange, scan_from_cp

    if cp <= 1:
        return {}
    local = seq_len // cp
    chunk = local // 2
    hv, dk, dv = text_config.linear_num_value_heads // tp, text_config.linear_key_head_dim, text_config.linear_value_head_dim
    conv_dim = (2 * text_config.linear_num_key_heads * dk + text_config.linear_num_value_heads * dv) // tp
    halo = (cp - 1) * 2 * conv_dim * min(chunk, text_config.linear_conv_kernel_dim - 1) * compute_bytes
    chosen = resolve_exchange(exchange, cp, backend)
    states = exchange_bytes(chosen, cp, hv, dk, dv)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    kv_heads = max(1, text_config.num_key_value_heads // tp)
    attention = (cp - 1) * 2 * kv_heads * local * head_dim * compute_bytes
    why = f"auto: the scan from cp {scan_from_cp(backend)} on {backend}" if exchange == "auto" else "QWEN35_ACCEL_CP_STATE_EXCHANGE"
    return {
        "seq_len": seq_len,
        "layout": [f"rank {r}: chunks {r} and {2 * cp - 1 - r} of {2 * cp} ({chunk} tokens each)" for r in range(cp)],
        "backend": backend,
        "state_exchange": chosen,
        "state_exchange_reason": why,
        "linear_attention_bytes_per_rank": halo + states["forward"],
        "state_exchange_bytes_per_rank": states["forward"],
        "state_exchange_kept_bytes_per_rank": states["kept"],
        "full_attention_bytes_per_rank": attention,
        "note": "per sequence, forward, max over ranks; GatedDeltaNet traffic does not grow with seq_len, attention K/V does",
    }


def _unit_label(modules: list[str]) -> str:
    """A unit's modules in at most 52 characters (if they do not fit: the first and a count)."""
    if not modules or modules == [""]:
        return "(root)"
    label = "+".join(modules)
    if len(label) > 52 and len(modules) > 1:
        label = f"{modules[0]} +{len(modules) - 1} more"
    return label[-52:]


def _vision_tower_choice(model: str, config: Any, choice: str | None, image_tokens: int, tokens: int) -> str:
    """`--vision-tower` checked against the config: "trainable", "frozen" or "none"."""
    if choice is not None and choice not in VISION_TOWER_CHOICES:
        raise PlanError(f"--vision-tower {choice!r} is not one of {', '.join(VISION_TOWER_CHOICES)}; pass one of them")
    if getattr(config, "vision_config", None) is None:
        if choice in ("trainable", "frozen") or image_tokens:
            given = f"--vision-tower {choice}" if choice in ("trainable", "frozen") else f"--image-tokens {image_tokens}"
            raise PlanError(f"{given}: --model {model} is a text model without a vision tower; drop the flag or pass a VLM config")
        return "none"
    choice = choice or "trainable"
    if image_tokens < 0 or image_tokens > tokens or (choice == "none" and image_tokens):
        need = "0 with --vision-tower none" if choice == "none" else f"0 to {tokens} (batch size x seq len: they are part of the sequence)"
        raise PlanError(f"--image-tokens {image_tokens}: pass {need}")
    return choice


def _meta_model(config: Any, storage: Any, vision_tower: str) -> Any:
    """The model a run would load, on the meta device: the VLM (`AutoModelForImageTextToText`)
    for a config with a vision tower unless `vision_tower` is "none", then frozen if "frozen"
    (before Accelerate's upcast, which leaves frozen parameters in their storage dtype)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForCausalLM if vision_tower == "none" else AutoModelForImageTextToText
    with torch.device("meta"):
        net = auto.from_config(config, dtype=storage)
    if vision_tower == "frozen":
        from .model.detect import qwen35_parts

        qwen35_parts(net).vision_model.requires_grad_(False)  # type: ignore[union-attr]
    return net


def _in_vision(module: str) -> bool:
    return "visual" in module.split(".")


def _vision_report(net: Any, rows: list[dict[str, Any]], shards: int, vision_tower: str, sharding: str) -> dict[str, Any] | None:
    """Where FSDP2 holds a VLM's vision tower and its bytes on the most loaded rank: `rows`,
    the tower's own units (`_units` rows); the parameters the root unit holds; those left
    unsharded (replicated on every rank). None for a text model."""
    from .model.detect import qwen35_parts
    from .parallel.fsdp import fsdp_units

    visual = qwen35_parts(net).vision_model
    if visual is None or vision_tower == "none":
        return None
    params = list(visual.parameters())
    in_units = {id(p) for names, record in fsdp_units(net) if not all(map(_in_vision, names)) for p in record.parameters()}
    in_own_units = {id(p) for names, record in fsdp_units(net) if all(map(_in_vision, names)) for p in record.parameters()}
    root_held = [p for p in params if id(p) in in_units]
    replicated = [p for p in params if id(p) not in in_units and id(p) not in in_own_units]
    root_bytes = max(_unit_bytes(root_held, shards, set(), 1)[0]) if root_held else 0
    replicated_bytes = sum(p.numel() * p.element_size() for p in replicated)
    trainable = any(p.requires_grad for p in params)
    return {
        "trainable": trainable,
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


def plan(
    model: str,
    config: str,
    seq_len: int = 4096,
    backend: str = "nccl",
    *,
    batch_size: int = 1,
    optimizer: str = "adamw",
    gpu_memory: int | None = None,
    suggest: bool = False,
    vision_tower: str | None = None,
    image_tokens: int = 0,
) -> dict[str, Any]:
    """The plan as a dict (what `plan --json` prints); `backend` of the cp group (its
    automatic state exchange depends on it; nccl: the memory of a CUDA step, gloo: of a CPU
    one); `gpu_memory` bytes per GPU for the verdict (`memory_model.memory_report`).
    `vision_tower` (a VLM config): "trainable" (default), "frozen", or "none" (the text
    model alone, as `AutoModelForCausalLM` loads it); `image_tokens`: image and video tokens
    per rank's micro-batch, whole sequences (0: a text-only step)."""
    import torch
    import torch.distributed as dist
    from accelerate.parallelism_config import ParallelismConfig

    from . import memory_model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from .integrations.settings import PluginSettings
    from .parallel.fsdp import describe_prefetch
    from .parallel.mesh import ParallelDims
    from .parallelization import PARALLELIZER

    started = time.perf_counter()
    cluster = _load_yaml(config)
    sizes = _sizes(cluster)
    mixed = str(cluster.mixed_precision or "no").lower()
    fsdp = cluster.fsdp_config or {}
    model_config = _model_config(model)
    text_config = model_config.get_text_config()
    if seq_len % (2 * sizes["cp"]):
        raise PlanError(f"--seq-len {seq_len} is not divisible by 2*cp = {2 * sizes['cp']}; pass a multiple of it")
    vision_tower = _vision_tower_choice(model, model_config, vision_tower, image_tokens, batch_size * seq_len)

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=sizes["world"])  # collectives are no-ops
    mesh = ParallelDims.from_parallelism_config(
        ParallelismConfig(
            dp_replicate_size=sizes["dp_replicate"], dp_shard_size=sizes["dp_shard"], cp_size=sizes["cp"], tp_size=sizes["tp"]
        ),
        "cpu",
    ).mesh

    storage = getattr(model_config, "dtype", None) or torch.float32
    if isinstance(storage, str):
        storage = getattr(torch, storage)
    net = _meta_model(model_config, storage, vision_tower)
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed)
    if compute is not None:  # as Accelerate: fp32 master weights, compute in the policy's dtype
        for p in net.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute is not None else None)
    total_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    total_params = sum(p.numel() for p in net.parameters())
    settings = PluginSettings.from_env()
    error = None
    try:
        PARALLELIZER.apply(
            net,
            mesh,
            mp_policy=policy,
            activation_checkpointing=bool(fsdp.get("fsdp_activation_checkpointing")),
            reshard_after_forward=fsdp.get("fsdp_reshard_after_forward", True),
            # as the plugin would, from the same QWEN35_ACCEL_* variables
            frozen_multimodal_sharding=settings.frozen_multimodal_sharding,  # type: ignore[arg-type]
            fp32_holder_units=settings.fp32_holder_units,  # type: ignore[arg-type]
            vocab_parallel_lm_head=settings.vocab_parallel_lm_head,
            enable_fsdp2_prefetch=settings.fsdp2_prefetch,
            fsdp2_forward_prefetch_depth=settings.fsdp2_forward_prefetch_depth,
            fsdp2_backward_prefetch_depth=settings.fsdp2_backward_prefetch_depth,
        )
    except NotImplementedError as exc:
        error = str(exc)
    except ValueError as exc:  # a configuration the model cannot take (e.g. tp not dividing the heads)
        raise PlanError(str(exc)) from None

    shards = sizes["dp_shard"] * sizes["cp"]
    units = _units(net, shards, sizes["tp"]) if error is None else []
    layers: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    def layer_of(module: str) -> int | None:
        parts = module.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts) and "visual" not in parts:
            return int(parts[parts.index("layers") + 1])
        return None

    vision_rows = [u for u in units if u["modules"] and all(_in_vision(m) for m in u["modules"])]
    for unit in units:
        if any(unit is row for row in vision_rows):
            continue
        owners = {layer_of(m) for m in unit["modules"]}
        index = owners.pop() if len(owners) == 1 else None  # a unit over several layers is listed apart
        if index is not None:
            while len(layers) <= index:
                layers.append({"layer": len(layers), "type": text_config.layer_types[len(layers)], "units": []})
            layers[index]["units"].append(unit)
        else:
            other.append(unit)
    sharded_total = sum(u["bytes_all_ranks"] for u in units)
    tower = _vision_report(net, vision_rows, shards, vision_tower, settings.frozen_multimodal_sharding) if error is None else None
    compute_bytes = _DTYPE_BYTES.get(str(compute or storage).removeprefix("torch."), 4)
    try:
        step = memory_model.StepOptions(
            seq_len=seq_len, batch_size=batch_size, compute_bytes=compute_bytes, optimizer=optimizer,
            param_bytes=4 if compute is not None else _DTYPE_BYTES.get(str(storage).removeprefix("torch."), 4),
            activation_checkpointing=bool(fsdp.get("fsdp_activation_checkpointing")),
            tiled_loss=settings.tiled_loss,
            forward_prefetch_depth=settings.fsdp2_forward_prefetch_depth if settings.fsdp2_prefetch else 0,
            backward_prefetch_depth=settings.fsdp2_backward_prefetch_depth if settings.fsdp2_prefetch else 0,
            device="cuda" if backend == "nccl" else "cpu",
        )
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    parallel = memory_model.Parallel(sizes["dp_replicate"], sizes["dp_shard"], sizes["cp"], sizes["tp"], settings.vocab_parallel_lm_head)
    vision = None
    if vision_tower != "none":
        vision = memory_model.VisionTower(
            memory_model.VisionShape.from_config(model_config), trainable=vision_tower == "trainable",  # type: ignore[arg-type]
            frozen_sharding=settings.frozen_multimodal_sharding, image_tokens=image_tokens,
            storage_bytes=_DTYPE_BYTES.get(str(storage).removeprefix("torch."), 4),
        )
    if tower is not None and vision is not None:
        tower.update(
            image_tokens=image_tokens, patches_per_rank=vision.patches_per_rank(parallel), cp=sizes["cp"],
            memory_per_rank=memory_model.vision_estimate(vision, parallel, step).as_dict(),
        )
    memory = memory_model.memory_report(
        memory_model.ModelShape.from_config(model_config), parallel, step, gpu_memory, suggest, vision
    )
    replicated = tower["replicated_bytes_per_rank"] if tower else 0
    return {
        "model": model if model in ("tiny", "tiny-vlm") else os.path.abspath(model),
        "architecture": type(net).__name__.removeprefix("FSDP"),
        "config": os.path.abspath(config),
        "mesh": sizes,
        "fsdp_shards": shards,
        "mixed_precision": mixed,
        "parameters": total_params,
        "model_bytes": total_bytes,
        "sharded_bytes_all_ranks": sharded_total + replicated,
        "bytes_per_rank_max": sum(u["bytes_per_rank_max"] for u in units) + replicated,
        "layers": layers,
        "other_units": other,
        "vision_tower": tower,
        "prefetch": describe_prefetch(net) if error is None else {},
        "context_parallel": _cp_comm(
            text_config, sizes["cp"], sizes["tp"], seq_len, compute_bytes, settings.cp_state_exchange, backend
        ),
        "tensor_parallel": {"tp": sizes["tp"], "status": error or ("none" if sizes["tp"] == 1 else "applied")},
        **memory,
        "seconds": round(time.perf_counter() - started, 2),
    }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _print_vision(v: dict[str, Any], row: str) -> None:
    """The vision tower's lines of `print_plan`."""
    how = {
        "units": "one FSDP2 unit per block; patch/position embedding and merger in the root unit",
        "root": "every parameter in the root unit (gathered for the whole step)",
        "replicate": "not sharded: whole on every rank",
    }[v["layout"]]
    state = "trainable" if v["trainable"] else f"frozen, QWEN35_ACCEL_FROZEN_MULTIMODAL_SHARDING={v['frozen_multimodal_sharding']}"
    print(f"vision tower ({v['parameters']:,} parameters; {state}): {how}")
    for u in v["units"]:
        print(row.format(_unit_label(u["modules"]), u["storage"], u["compute"], f"{u['params']:,}", _human(u["bytes_per_rank_max"])))
    where = [f"{v['unit_count']} units of at most {_human(v['bytes_per_unit_max'])} per rank"] if v["unit_count"] else []
    if v["root_parameters"]:
        where.append(f"in the root unit {v['root_parameters']:,} parameters, {_human(v['root_bytes_per_rank'])} per rank")
    if v["replicated_parameters"]:
        where.append(f"replicated {v['replicated_parameters']:,} parameters, {_human(v['replicated_bytes_per_rank'])} per rank")
    print(f"  {'; '.join(where)}; the tower's parameters per rank (max): {_human(v['bytes_per_rank'])}")


def print_plan(p: dict[str, Any]) -> None:
    """The plan as `qwen35-accel plan` prints it."""
    m = p["mesh"]
    print(f"{p['architecture']} ({p['parameters']:,} parameters, {_human(p['model_bytes'])}) from {p['model']}")
    print(
        f"mesh: world {m['world']} = dp_replicate {m['dp_replicate']} x dp_shard {m['dp_shard']} x cp {m['cp']} x tp {m['tp']}; "
        f"FSDP2 shards over dp_shard_cp = {p['fsdp_shards']}; mixed_precision {p['mixed_precision']}"
    )
    if p["tensor_parallel"]["tp"] > 1:
        print(f"tensor parallelism: {p['tensor_parallel']['status']} (by heads; sizes below are this rank's slices)")
    row = "  {:<52} {:>9} {:>9} {:>13} {:>12}"
    print(row.format("unit (modules)", "storage", "compute", "params", "bytes/rank"))
    for layer in p["layers"]:
        print(f"layer {layer['layer']} ({layer['type']})")
        for u in layer["units"]:
            print(row.format(_unit_label(u["modules"]), u["storage"], u["compute"], f"{u['params']:,}", _human(u["bytes_per_rank_max"])))
    print("other units")
    for u in p["other_units"]:
        print(row.format(_unit_label(u["modules"]), u["storage"], u["compute"], f"{u['params']:,}", _human(u["bytes_per_rank_max"])))
    if p["vision_tower"]:
        _print_vision(p["vision_tower"], row)
    print(
        f"parameters per rank (max): {_human(p['bytes_per_rank_max'])}; distinct bytes over all ranks: "
        f"{_human(p['sharded_bytes_all_ranks'])} (model: {_human(p['model_bytes'])})"
    )
    forward, backward = p["prefetch"].get("forward", {}), p["prefetch"].get("backward", {})
    if forward or backward:
        first = next(iter(forward.items()), None)
        last_backward = next(iter(reversed(backward.items())), None)
        print(
            f"prefetch: {len(forward)} units gather ahead in forward, {len(backward)} in backward"
            + (f"; first: {first[0]} -> {', '.join(first[1])}" if first else "")
            + (f"; backward starts: {last_backward[0]} -> {', '.join(last_backward[1])}" if last_backward else "")
        )
        print("  (all-gathers overlap compute on accelerator streams; on CPU meshes they are asynchronous gloo work)")
    else:
        print("prefetch: none (QWEN35_ACCEL_FSDP2_PREFETCH=0): each unit gathers its parameters when it runs")
    cp = p["context_parallel"]
    if cp:
        print(f"context parallelism (seq_len {cp['seq_len']}):")
        for line in cp["layout"]:
            print(f"  {line}")
        print(
            f"  sent per rank per layer and sequence (forward; backward at most as much): linear_attention "
            f"{_human(cp['linear_attention_bytes_per_rank'])}, full_attention {_human(cp['full_attention_bytes_per_rank'])}"
        )
        print(
            f"  state exchange: {cp['state_exchange']} on {cp['backend']} ({cp['state_exchange_reason']}): sends "
            f"{_human(cp['state_exchange_bytes_per_rank'])}, keeps {_human(cp['state_exchange_kept_bytes_per_rank'])} "
            "for backward per GatedDeltaNet layer"
        )
    from .memory_model import describe, describe_vision

    print("\n".join(describe(p, m["world"])))
    if p["vision_tower"]:
        print("\n".join(describe_vision(p["vision_tower"])))
    print(f"planned in {p['seconds']} s, nothing materialised (meta device)")


def memory_options(gpu_memory: str | None, batch_size: int, optimizer: str, suggest: bool) -> int | None:
    """Check the memory options before anything is built; return `gpu_memory` in bytes."""
    from .memory_model import StepOptions, parse_bytes

    if suggest and gpu_memory is None:
        raise PlanError("--suggest needs --gpu-memory (e.g. --gpu-memory 141GB)")
    try:
        StepOptions(seq_len=1, batch_size=batch_size, optimizer=optimizer)
    except ValueError as error:
        raise PlanError(f"--batch-size/--optimizer: {error}") from None
    try:
        return None if gpu_memory is None else parse_bytes(gpu_memory)
    except ValueError as error:
        raise PlanError(f"--gpu-memory {error}") from None
