"""What `plan` says about memory: `memory_report` (the `--json` keys), its lines
(`describe`, `describe_vision`), the smallest cp that fits (`suggest_cp`), the longest
context that fits (`longest_seq_len`) and memory sizes as users write them (`parse_bytes`)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict
from typing import Any

from .offload import RECOMPUTE_AND_BACKWARD, offload_timing
from .shapes import Parallel, StepOptions
from .step import step_estimate
from .vision_tower import VisionTower


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'141GB', '139.8 GiB', '80000MB', '1024' (bytes) -> bytes; ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"{text!r} is not a memory size; pass a positive number with a unit, e.g. 141GB, 139.8GiB or 80000MB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def suggest_cp(
    shape: ModelShape, parallel: Parallel, options: StepOptions, gpu_bytes: int, vision: VisionTower | None = None
) -> int | None:
    """The smallest cp (checkpointing on) whose plan fits `gpu_bytes` with the same world
    size and tp (cp taken from dp_shard), or None. cp must divide the world left by tp and
    dp_replicate, and 2·cp must divide seq_len. `vision`: a VLM's tower (`step_estimate`)."""
    budget = parallel.world // (parallel.tp * parallel.dp_replicate)
    checkpointed = _replace(options, activation_checkpointing=True)
    for cp in range(1, budget + 1):
        if budget % cp or options.seq_len % (2 * cp if cp > 1 else 1):
            continue
        ep = parallel.ep if budget % parallel.ep == 0 else 1  # ep is carved out of dp_shard × cp: unchanged by cp
        candidate = Parallel(parallel.dp_replicate, budget // cp, cp, parallel.tp, parallel.vocab_parallel_lm_head, ep)
        if step_estimate(shape, candidate, checkpointed, vision).total <= gpu_bytes:
            return cp
    return None


def suggest_ep(shape: ModelShape, parallel: Parallel, options: StepOptions, gpu_bytes: int) -> int | None:
    """A MoE model's smallest ep above the configured one whose plan fits `gpu_bytes` at this mesh
    (ep must divide the experts and dp_shard × cp; with tp it must be dp_shard × cp, without HSDP,
    and ep × tp divide the experts), or None (dense, or none fits). ep shrinks the experts a layer
    gathers to compute, not the shards a rank holds."""
    if not shape.experts:
        return None
    for ep in range(parallel.ep + 1, parallel.fsdp_shards + 1):
        if shape.experts % ep or parallel.fsdp_shards % ep:
            continue
        if parallel.tp > 1 and (ep != parallel.fsdp_shards or parallel.dp_replicate > 1 or shape.experts % (ep * parallel.tp)):
            continue
        candidate = Parallel(parallel.dp_replicate, parallel.dp_shard, parallel.cp, parallel.tp, parallel.vocab_parallel_lm_head, ep)
        if step_estimate(shape, candidate, options).total <= gpu_bytes:
            return ep
    return None


def longest_seq_len(
    shape: ModelShape, parallel: Parallel, options: StepOptions, gpu_bytes: int, step: int = 1024,
    vision: VisionTower | None = None,
) -> int:
    """The longest multiple of `step` (and of 2·cp) whose plan fits `gpu_bytes`; 0 if none.
    `vision`: a VLM's tower, its image tokens unchanged (`step_estimate`)."""
    step = math.lcm(step, 2 * parallel.cp)
    if step_estimate(shape, parallel, _replace(options, seq_len=step), vision).total > gpu_bytes:
        return 0
    low, high = 1, 2
    while step_estimate(shape, parallel, _replace(options, seq_len=high * step), vision).total <= gpu_bytes:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if step_estimate(shape, parallel, _replace(options, seq_len=middle * step), vision).total <= gpu_bytes:
            low = middle
        else:
            high = middle
    return low * step


def _replace(options: StepOptions, **changes: Any) -> StepOptions:
    return StepOptions(**{**asdict(options), **changes})


def _gib(n: int) -> str:
    """Bytes in GiB (MiB below 1 GiB: tiny models)."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.2f} MiB"


def memory_report(
    shape: ModelShape, parallel: Parallel, options: StepOptions, gpu_bytes: int | None = None, suggest: bool = False,
    vision: VisionTower | None = None,
) -> dict[str, Any]:
    """What `plan --json` carries: `memory_per_rank` (bytes), the step it assumes, and with
    `gpu_bytes` whether it fits (`fits`, `margin_bytes` = gpu_bytes − total) and, with
    `suggest`, `suggested_cp` (`suggest_cp`; None if no cp fits). `vision`: a VLM's tower,
    included in `memory_per_rank` (`step_estimate`)."""
    per_rank = step_estimate(shape, parallel, options, vision).as_dict()
    report: dict[str, Any] = {"memory_per_rank": per_rank, "memory_assumptions": asdict(options)}
    if gpu_bytes is not None:
        report.update(gpu_memory_bytes=gpu_bytes, fits=per_rank["total"] <= gpu_bytes, margin_bytes=gpu_bytes - per_rank["total"])
        if suggest:
            report["suggested_cp"] = suggest_cp(shape, parallel, options, gpu_bytes, vision)
            if shape.experts and per_rank["total"] > gpu_bytes:
                report["suggested_ep"] = suggest_ep(shape, parallel, options, gpu_bytes)
            if per_rank["total"] > gpu_bytes and not options.activation_offload:
                # Offload where the run as configured does not fit: checkpointing with its inputs on the host.
                offloaded = step_estimate(shape, parallel, _replace(options, activation_checkpointing=True,
                                                                    activation_offload=True), vision).as_dict()
                report["suggested_offload"] = offloaded if offloaded["total"] <= gpu_bytes else None
    if options.activation_offload:  # host bytes, and the copies' time per layer against its compute
        report["offload"] = {"host_bytes_per_rank": per_rank["host_activations"], **offload_timing(shape, parallel, options)}
    return report


def describe(report: dict[str, Any], gpus: int) -> list[str]:
    """`memory_report` as the lines `plan` prints."""
    m, o = report["memory_per_rank"], report["memory_assumptions"]
    loss = f"tiled loss ({o['tiled_loss']})" if o["tiled_loss"] != "off" else "Transformers' loss"
    kernels = "FLA/causal-conv1d" if o["fla"] and o["device"] == "cuda" else "torch"
    lines = [
        f"memory per rank (seq_len {o['seq_len']}, batch {o['batch_size']}, {o['optimizer']}, "
        f"checkpointing {'on' if o['activation_checkpointing'] else 'off'}"
        f"{' with offload' if o.get('activation_offload') else ''}, {loss}, {kernels} GatedDeltaNet kernels):",
        "  " + ", ".join(f"{key} {_gib(value)}" for key, value in m.items()
                         if key not in ("total", "host_activations") and (key != "reference_parameters" or o.get("reference_model"))),
        f"  total {_gib(m['total'])}",
    ]
    if o.get("reference_model"):
        lines.insert(2, f"  reference model (--ref-model): a frozen copy in the policy's FSDP2 units, in the checkpoint's dtype, "
                        f"{_gib(m['reference_parameters'])}; no gradients, optimizer state or saved activations (no_grad forwards)")
    if "offload" in report:
        off = report["offload"]
        lines.append(f"  activation offload: {_gib(off['host_bytes_per_rank'])} of host memory per rank{_per_node(off)}, "
                     f"{_gib(off['bytes_per_layer'])} per layer each way, "
                     f"{off['seconds_per_layer_each_way'] * 1e3:.1f} ms at an assumed {off['host_link_bytes_per_s'] / 1e9:.0f} GB/s host link")
        lines += _host_verdict(off)
        names = {"linear_attention": "GatedDeltaNet", "full_attention": "attention"}
        forward = " / ".join(f"{t * 1e3:.1f} ms ({names[kind]})" for kind, t in off["forward_seconds_per_layer"].items())
        lines.append(f"  offload against compute: a layer's forward {forward} at an assumed {off['device_flops_per_s'] / 1e12:.0f} "
                     f"TFLOP/s dense peak (H100/H200) x {off['assumed_mfu']:.0%} MFU; the copy to the host "
                     f"{'hidden' if off['copy_to_host_hidden'] else 'NOT hidden'} behind that layer's forward, the copy back "
                     f"{'hidden' if off['copy_back_hidden'] else 'NOT hidden'} behind the recompute and backward of the layer "
                     f"above it (~{RECOMPUTE_AND_BACKWARD}x a forward)")
    if "fits" in report:
        margin, budget = report["margin_bytes"], _gib(report["gpu_memory_bytes"])
        lines.append(f"  fits in {budget}: {_gib(margin)} to spare" if report["fits"]
                     else f"  does not fit in {budget}: {_gib(-margin)} over")
    if "suggested_cp" in report:
        cp = report["suggested_cp"]
        lines.append(
            f"  suggested: cp {cp} with activation checkpointing (the smallest that fits; dp_shard takes the rest of the {gpus} GPUs)" if cp
            else f"  suggested: none: no cp on {gpus} GPUs fits, even with activation checkpointing"
        )
    if "suggested_ep" in report:
        ep = report["suggested_ep"]
        lines.append(f"  suggested: QWEN35_ACCEL_EP={ep} at this mesh (each rank gathers 1/{ep} of a layer's experts)" if ep
                     else "  suggested: no ep fits at this mesh")
    if report.get("suggested_offload"):
        s = report["suggested_offload"]
        lines.append(f"  suggested: activation offload (fsdp_activation_checkpointing and fsdp_activation_checkpointing_offload: "
                     f"true) at this mesh: total {_gib(s['total'])} on the device, {_gib(s['host_activations'])} of host memory "
                     f"per rank{_per_node(s)}")
        lines += _host_verdict(s)
    return lines


def _per_node(offload: dict[str, Any]) -> str:
    """The per-node part of an offload line (`host_per_node`'s keys, when `plan` added them)."""
    if "host_bytes_per_node" not in offload:
        return " (times the ranks of a node: host memory is per node)"
    return f" x {offload['ranks_per_node']} ranks per node = {_gib(offload['host_bytes_per_node'])} per node"


def _host_verdict(offload: dict[str, Any]) -> list[str]:
    """The --host-memory verdict line, when given."""
    if "host_fits" not in offload:
        return []
    budget = f"{offload['host_memory_share']:.0%} of {_gib(offload['host_memory_bytes'])} per node (--host-memory)"
    return [f"  offloaded inputs {'fit in' if offload['host_fits'] else 'do NOT fit in'} {budget}"]


def describe_vision(tower: dict[str, Any]) -> list[str]:
    """The vision tower's memory line under `describe`'s; `tower`: `plan`'s `vision_tower`
    (`layout`, `image_tokens`, `patches_per_rank`, `cp`, `memory_per_rank` from `vision_estimate`)."""
    if tower["image_tokens"]:
        step = f"{tower['image_tokens']} image tokens per micro-step, {tower['patches_per_rank']} patches per rank"
        if tower["cp"] > 1:
            step += f", assumed split evenly over the cp {tower['cp']} ranks"
    else:
        step = "a text-only step: --image-tokens 0" + (
            f", the placeholder image's {tower['patches_per_rank']} patches" if tower["layout"] == "units" else "")
    memory = tower["memory_per_rank"]
    return [f"  of which vision tower ({step}): "
            + ", ".join(f"{key} {_gib(value)}" for key, value in memory.items()
                        if key not in ("loss", "total") and (key != "reference_parameters" or value))]
