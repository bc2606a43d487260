"""Parallelism layouts Accelerate refuses with misleading advice: refused first, naming what works."""

from __future__ import annotations

import os


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

