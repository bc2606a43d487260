"""`plan` as `qwen35-accel plan` prints it (without `--json`)."""

from __future__ import annotations

from typing import Any

from ..memory import describe, describe_vision


def _unit_label(modules: list[str]) -> str:
    """A unit's modules in at most 52 characters (if they do not fit: the first and a count)."""
    if not modules or modules == [""]:
        return "(root)"
    label = "+".join(modules)
    if len(label) > 52 and len(modules) > 1:
        label = f"{modules[0]} +{len(modules) - 1} more"
    return label[-52:]


def _run_line(run: dict[str, str]) -> str:
    """The run planned: device, backend, kernels, and what decided them."""
    if run["device"] == "cpu":
        what = "CPU processes over gloo, Transformers' torch GatedDeltaNet kernels"
        other = "--backend nccl plans the CUDA run"
    else:
        what = "CUDA over nccl, FLA and causal-conv1d GatedDeltaNet kernels (assumed installed)"
        other = "--backend gloo plans a CPU run"
    return f"run planned: {what} (from {run['source']}; {other})"


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
    print(_run_line(p["run"]))
    if p["tensor_parallel"]["tp"] > 1:
        print(f"tensor parallelism: {p['tensor_parallel']['status']} (by heads; sizes below are this rank's slices)")
    if p.get("experts"):
        e = p["experts"]
        print(f"experts: {e['per_layer']} per layer, top {e['per_token']}; ep {e['ep']} x efsdp {e['efsdp']} "
              f"(a rank computes with {e['per_layer'] // e['ep'] // p['tensor_parallel']['tp']} experts per layer"
              f"{', split over tp' if p['tensor_parallel']['tp'] > 1 else ''}; QWEN35_ACCEL_EP)")
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
    if p.get("reference_model"):
        print(f"reference model (frozen copy, e.g. TRL's ref_model): the same units in the checkpoint's dtype, "
              f"{_human(p['reference_model']['bytes_per_rank_max'])} "
              "per rank (max) more; no gradients, optimizer state or saved activations")
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
    print("\n".join(describe(p, m["world"])))
    if p["vision_tower"]:
        print("\n".join(describe_vision(p["vision_tower"])))
    print(f"planned in {p['seconds']} s, nothing materialised (meta device)")
