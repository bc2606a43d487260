"""`qwen35-accel plan`: what a launch will do, without GPUs or weights.

`plan` builds the model on the meta device and runs the real parallelizer in one
process over a fake process group of the config's world size (torch's "fake" backend:
collectives are no-ops, shapes and placements are real; removed afterwards, so plans of
several world sizes can follow one another in one process), then reports the run it plans
(a CPU YAML: CPU processes over gloo with torch's kernels; a GPU YAML: CUDA over nccl with
FLA and causal-conv1d, on any machine), the mesh, every FSDP2 unit per decoder layer
(modules, storage/compute dtype, parameters, bytes per rank), a VLM's vision tower (its
units, or where else FSDP2 holds it, and its bytes per rank), the context-parallel layout
with its per-layer communication, and the memory of a training step per rank.

Modules: `config` (the YAML, the run, the options), `units` (the meta model as the
parallelizer lays it out), `comm` (CP traffic), `step_inputs` (the memory model's inputs),
`text` (the printed plan).
"""

from __future__ import annotations

import os
import time
from typing import Any

from .config import (
    VISION_TOWER_CHOICES,
    PlanError,
    check_engine,
    host_memory_option,
    load_yaml,
    memory_options,
    mesh_sizes,
    model_config,
    planned_run,
    vision_tower_choice,
)
from .text import print_plan

__all__ = ["VISION_TOWER_CHOICES", "PlanError", "host_memory_option", "memory_options", "plan", "print_plan"]


def _experts(config: Any, ep: int, shards: int) -> dict[str, int] | None:
    """A MoE model's experts as planned (None for dense): per layer, per token, ep and efsdp."""
    text = config.get_text_config()
    if not getattr(text, "num_experts", 0):
        return None
    return {"per_layer": text.num_experts, "per_token": text.num_experts_per_tok, "ep": ep, "efsdp": shards // ep}


def _fsdp_choices(cluster: Any) -> tuple[bool, bool, Any]:
    """The YAML's activation checkpointing, its offload, and FSDP2's resharding after forward."""
    fsdp = cluster.fsdp_config or {}
    checkpointing = bool(fsdp.get("fsdp_activation_checkpointing"))
    return checkpointing, checkpointing and bool(fsdp.get("fsdp_activation_checkpointing_offload")), fsdp.get(
        "fsdp_reshard_after_forward", True)


def _units(net: Any, parts: Any, sizes: dict[str, int], policy: Any, settings: Any, vision_tower: str,
           error: str | None) -> tuple[list[Any], list[dict[str, Any]], Any, Any, dict[str, Any] | None]:
    """The meta model's FSDP2 units as planned: (units, their rows, by decoder layer, the other units,
    the vision tower's report or None); nothing where the layout failed (`error`)."""
    from ..parallel.fsdp import fsdp_units
    from .units import by_layer, held_expert_rows, unit_rows, vision_report

    shards = sizes["dp_shard"] * sizes["cp"]
    units = fsdp_units(net) if error is None else []
    rows = unit_rows(net, units, shards, sizes["tp"]) if units else []
    rows += held_expert_rows(net, sizes["tp"], policy.param_dtype if policy else None) if units else []
    layers, vision_rows, other = by_layer(rows, parts.layer_types)
    tower = None
    if error is None and parts.vision_model is not None and vision_tower != "none":
        tower = vision_report(parts.vision_model, units, vision_rows, shards, settings.parallel.frozen_multimodal_sharding)
    return units, rows, layers, other, tower


def _reference_model(rows: list[dict[str, Any]], precision: Any, replicated: int, memory: dict[str, Any]) -> dict[str, Any]:
    """A frozen reference model prepared as the policy is: its units, in the checkpoint's dtype, nothing else."""
    from .units import reference_unit_bytes

    return {"units": "the policy's", "bytes_per_rank_max": reference_unit_bytes(rows, precision.storage) + replicated,
            "memory_bytes_per_rank": memory["memory_per_rank"]["reference_parameters"],
            "gradients": 0, "optimizer_states": 0, "activations": 0}


def _host_memory_verdict(memory: dict[str, Any], world: int, machines: int, host_memory: int | None) -> None:
    """Activation offload's host memory per node (`memory.host_per_node`), configured or suggested,
    added to `memory`; PlanError for `host_memory` where nothing is offloaded."""
    from ..memory import host_per_node

    if "offload" in memory:
        memory["offload"].update(host_per_node(memory["offload"]["host_bytes_per_rank"], world, machines, host_memory))
    elif memory.get("suggested_offload"):
        memory["suggested_offload"].update(host_per_node(memory["suggested_offload"]["host_activations"], world, machines,
                                                         host_memory))
    elif host_memory is not None:
        raise PlanError("--host-memory: nothing is kept in host memory in this plan (no activation offload: set "
                        "fsdp_activation_checkpointing_offload: true, or pass --gpu-memory and --suggest where offload "
                        "would make the run fit)")


def plan(
    model: str,
    config: str,
    seq_len: int = 4096,
    backend: str | None = None,
    *,
    batch_size: int = 1,
    optimizer: str = "adamw",
    gpu_memory: int | None = None,
    host_memory: int | None = None,
    suggest: bool = False,
    vision_tower: str | None = None,
    image_tokens: int = 0,
    reference_model: bool = False,
) -> dict[str, Any]:
    """The plan as a dict (what `plan --json` prints). `backend`: None plans the YAML's run
    (`planned_run`), or "gloo" / "nccl"; `gpu_memory` bytes per GPU for the verdict; `host_memory`
    bytes per node for activation offload's (PlanError where nothing is offloaded). `vision_tower`
    (a VLM config): "trainable" (default), "frozen" or "none"; `image_tokens`: image and video tokens
    per rank's micro-batch. `reference_model`: a frozen copy prepared as the policy is (TRL's
    `ref_model`), counted once more in the checkpoint's dtype, without gradients, optimizer state or
    activations (`reference_model` in the result, `memory_per_rank["reference_parameters"]`)."""
    from ..settings import PluginSettings
    from ..parallel.fsdp import describe_prefetch
    from .comm import cp_comm
    from .units import fake_world, meta_model, parallelize
    from .step_inputs import step_memory

    started = time.perf_counter()
    cluster = load_yaml(config)
    check_engine(cluster, config)
    sizes, run = mesh_sizes(cluster), planned_run(cluster, backend)
    mixed = str(cluster.mixed_precision or "no").lower()
    checkpointing, offload, reshard = _fsdp_choices(cluster)
    net_config = model_config(model)
    if seq_len % (2 * sizes["cp"]):
        raise PlanError(f"--seq-len {seq_len} is not divisible by 2*cp = {2 * sizes['cp']}; pass a multiple of it")
    vision_tower = vision_tower_choice(model, net_config, vision_tower, image_tokens, batch_size * seq_len)

    net, parts, policy, precision = meta_model(net_config, vision_tower, mixed)
    total_params, total_bytes = sum(p.numel() for p in net.parameters()), sum(p.numel() * p.element_size() for p in net.parameters())
    settings = PluginSettings.from_env()
    with fake_world(sizes["world"]):  # the layout's process group, gone when the plan is
        error = parallelize(net, sizes, policy, checkpointing, reshard, settings)
        shards = sizes["dp_shard"] * sizes["cp"]
        units, rows, layers, other, tower = _units(net, parts, sizes, policy, settings, vision_tower, error)
        memory, tower_step = step_memory(
            net_config, sizes, precision, run, settings, seq_len=seq_len, batch_size=batch_size, optimizer=optimizer,
            activation_checkpointing=checkpointing, activation_offload=offload, vision_tower=vision_tower, image_tokens=image_tokens,
            gpu_memory=gpu_memory, suggest=suggest, reference_model=reference_model,
        )
        if tower is not None and tower_step is not None:
            tower.update(tower_step)
        _host_memory_verdict(memory, sizes["world"], int(cluster.num_machines or 1), host_memory)
        replicated = tower["replicated_bytes_per_rank"] if tower else 0
        reference = _reference_model(rows, precision, replicated, memory) if reference_model else None
        return {
            "model": model if model in ("tiny", "tiny-vlm") else os.path.abspath(model),
            "architecture": type(net).__name__.removeprefix("FSDP"),
            "config": os.path.abspath(config),
            "run": run.as_dict(),
            "mesh": sizes,
            "fsdp_shards": shards,
            "mixed_precision": mixed,
            "parameters": total_params,
            "model_bytes": total_bytes,
            "sharded_bytes_all_ranks": sum(u["bytes_all_ranks"] for u in rows) + replicated,
            "bytes_per_rank_max": sum(u["bytes_per_rank_max"] for u in rows) + replicated,
            "layers": layers,
            "other_units": other,
            "vision_tower": tower,
            "reference_model": reference,
            "prefetch": describe_prefetch(net) if error is None else {},
            "context_parallel": cp_comm(net_config.get_text_config(), sizes["cp"], sizes["tp"], seq_len, precision.compute,
                                        settings.parallel.cp_state_exchange, run.backend),
            "tensor_parallel": {"tp": sizes["tp"], "status": error or ("none" if sizes["tp"] == 1 else "applied")},
            "experts": _experts(net_config, settings.parallel.ep, shards),
            **memory,
            "seconds": round(time.perf_counter() - started, 2),
        }
