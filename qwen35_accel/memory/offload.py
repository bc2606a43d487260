"""What activation offload costs: in time per decoder layer: its input's copy to the host and back
over the host link, against the compute that hides them, from a stated compute model; and in
host memory per node (`host_per_node`).

Each checkpointed layer's input ([batch, seq / cp, hidden] in the compute dtype) goes to the host
on a side stream while the layer that reads it runs its forward, and comes back (prefetched)
while the layer after it is recomputed and runs its backward, about 3× a forward (the recompute,
and a backward of twice the forward's FLOPs). A copy is hidden when it takes no longer than the
compute it overlaps. The compute model counts FLOPs (`layer_forward_flops`) and divides them by an
assumed device throughput: a dense peak times an assumed model FLOPs utilisation, both printed
beside the verdict (a faster or slower device scales the forward time, the verdict with it).
"""

from __future__ import annotations

from typing import Any

from .shapes import CHUNK, ModelShape, Parallel, StepOptions

# The host link per GPU and direction: PCIe Gen4 x16 as measured in practice (~25 GB/s; Gen5 and
# NVLink-C2C hosts are faster).
HOST_LINK_BYTES_PER_S = 25e9
# H100 / H200 SXM dense peak (no sparsity) by the compute dtype's size: bf16/fp16, and TF32 for fp32 compute.
DEVICE_PEAK_FLOPS_PER_S = {2: 989e12, 4: 494.5e12}
# The share of that peak a decoder layer's kernels reach (a typical long-context training MFU).
ASSUMED_MFU = 0.4
# Of a node's host memory, what the ranks' pinned offload buffers may take (pinned pages stay resident;
# the rest: the OS, data loaders, the checkpoint's staging, the optimizer's CPU side if any).
HOST_MEMORY_SHARE = 0.8
# A layer's recompute (one forward) and backward (two forwards' FLOPs): what the copy back overlaps.
RECOMPUTE_AND_BACKWARD = 3


def layer_forward_flops(shape: ModelShape, kind: str, parallel: Parallel, options: StepOptions) -> int:
    """Forward FLOPs of one decoder layer of `kind` on a rank (its batch × seq / cp local tokens,
    its 1/tp of the heads and of the MLP):
    - matmuls: 2 per tp-split parameter and token (the projections, the MLP, the conv's taps; the
      gate holder's 2 per head and the biases count alike, negligibly; the norms apart);
    - full attention under the causal mask: Q·Kᵀ and P·V, 2 FLOPs per multiply-add, a query seeing
      seq / 2 keys on average (also per CP rank: its two chunks mirror each other), so
      2 · heads/tp · head_dim · seq per local token;
    - GatedDeltaNet's chunked rule, per local token and value head: 4 · 64 · (k_dim + v_dim) for
      the in-chunk [64, 64] products (scores, their application, the UT transform's two) and
      6 · k_dim · v_dim for the state (read by the query and by the key, updated).
    Elementwise work (norms, gates, activations, softmax) is left out.
    """
    tokens = options.batch_size * options.seq_len // parallel.cp
    split, _norms = shape.layer_parameters(kind)
    flops = 2 * (split // parallel.tp) * tokens
    if kind == "full_attention":
        flops += 2 * (shape.heads // parallel.tp) * shape.head_dim * options.seq_len * tokens
    else:
        per_head = 4 * CHUNK * (shape.k_dim + shape.v_dim) + 6 * shape.k_dim * shape.v_dim
        flops += (shape.v_heads // parallel.tp) * per_head * tokens
    return flops


def offload_timing(
    shape: ModelShape, parallel: Parallel, options: StepOptions, *, host_link_bytes_per_s: float = HOST_LINK_BYTES_PER_S,
    device_flops_per_s: float | None = None, mfu: float = ASSUMED_MFU,
) -> dict[str, Any]:
    """`plan --json`'s `offload` timing keys: one layer's input bytes and their copy time each way
    at `host_link_bytes_per_s`; each layer kind's forward FLOPs and time at `device_flops_per_s`
    (default: `DEVICE_PEAK_FLOPS_PER_S` of the compute dtype) × `mfu`; and whether the copy to the
    host hides behind the forward of the layer reading that input (`copy_to_host_hidden`) and the
    copy back behind the recompute and backward of the layer after it (`copy_back_hidden`), for
    the cheaper layer kind (so for every layer)."""
    per_layer = options.batch_size * options.seq_len // parallel.cp * shape.hidden * options.compute_bytes
    seconds = per_layer / host_link_bytes_per_s
    peak = device_flops_per_s or DEVICE_PEAK_FLOPS_PER_S.get(options.compute_bytes, DEVICE_PEAK_FLOPS_PER_S[2])
    kinds = [kind for kind, count in (("linear_attention", shape.linear_layers), ("full_attention", shape.full_layers)) if count]
    flops = {kind: layer_forward_flops(shape, kind, parallel, options) for kind in kinds}
    forward = {kind: f / (peak * mfu) for kind, f in flops.items()}
    shortest = min(forward.values())
    return {
        "bytes_per_layer": per_layer, "host_link_bytes_per_s": host_link_bytes_per_s, "seconds_per_layer_each_way": seconds,
        "device_flops_per_s": peak, "assumed_mfu": mfu, "forward_flops_per_layer": flops, "forward_seconds_per_layer": forward,
        "copy_to_host_hidden": seconds <= shortest, "copy_back_hidden": seconds <= RECOMPUTE_AND_BACKWARD * shortest,
    }


def host_per_node(bytes_per_rank: int, world: int, machines: int, host_memory: int | None) -> dict[str, Any]:
    """Activation offload's host bytes per node: `bytes_per_rank` × the ranks of a node (`world /
    machines`), and with `host_memory` (bytes per node) whether they fit in HOST_MEMORY_SHARE of it."""
    ranks = max(1, world // max(1, machines))
    found: dict[str, Any] = {"ranks_per_node": ranks, "host_bytes_per_node": bytes_per_rank * ranks}
    if host_memory is not None:
        found.update(host_memory_bytes=host_memory, host_memory_share=HOST_MEMORY_SHARE,
                     host_fits=bytes_per_rank * ranks <= HOST_MEMORY_SHARE * host_memory)
    return found
