"""Replicate-only data parallelism with cp or tp > 1: refused first, naming the layouts that work.

Accelerate refuses `dp_replicate_size > 1` with `dp_shard_size == 1` and cp > 1 (and, before
1.16, tp > 1) in `ParallelismConfig`, with advice that contradicts itself (it asks for
`dp_replicate_size == 1` to compose HSDP); those are refused here first, for every model (the
outcome is Accelerate's, the advice ours). Accelerate 1.16 accepts the layout with tp > 1
(DDP x TP) and refuses it itself, with sound advice, under FSDP ("no dimension for FSDP to
shard across"): left to it.
"""

from __future__ import annotations

import os
from typing import Any


def accelerate_refuses_replicate_only_tp() -> bool:
    """Whether Accelerate's `ParallelismConfig` itself refuses replicate-only data parallelism
    with tp > 1 (before 1.16; cp > 1 it refuses in every version)."""
    import accelerate
    from packaging.version import Version

    return Version(accelerate.__version__).release < (1, 16)


def replicate_only_refusal(config: Any = None) -> ValueError | None:
    """At `Accelerator.__init__`, for every model: the error for a replicate-only layout that
    Accelerate itself refuses (cp > 1; tp > 1 before Accelerate 1.16), or None.

    `config`: the `ParallelismConfig` given to the Accelerator, or None for the one Accelerate
    builds from `PARALLELISM_CONFIG_*` (what `accelerate launch` sets from the YAML's
    `parallelism_config`). A config the caller built was checked by Accelerate when it was built.
    """
    if config is not None:
        return None

    def size(name: str) -> int:
        try:
            return int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))
        except ValueError:
            return 1  # Accelerate reports it

    replicate, shard, cp, tp = size("dp_replicate"), size("dp_shard"), size("cp"), size("tp")
    if not (replicate > 1 and shard == 1 and (cp > 1 or (tp > 1 and accelerate_refuses_replicate_only_tp()))):
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
        "composes cp (before 1.16 also tp) only with sharded data parallelism (dp_shard_size > 1) and refuses this "
        f"layout. Layouts that work on the same {world} processes: " + "; or ".join(layouts) + ". See "
        "docs/multi_node.md. (Refused by qwen35_accel before Accelerate's own check, whose advice contradicts itself.)"
    )
