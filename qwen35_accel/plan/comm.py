"""What context parallelism sends per layer: the layout of the chunks over the cp ranks, the
causal conv's halo, the GatedDeltaNet state exchange the run takes, attention's K/V all-gather."""

from __future__ import annotations

from typing import Any


def cp_comm(
    text_config: Any, cp: int, tp: int, seq_len: int, compute_bytes: int, exchange: str, backend: str
) -> dict[str, Any]:
    """Bytes each rank sends per layer and sequence, forward (backward sends as much back),
    by `benchmarks/cp_comm.py`'s convention: a ring all-gather sends (cp − 1) × its input.
    GatedDeltaNet heads and attention K/V heads are split over tp (head parallel)."""
    from ..parallel.context_parallel.state_exchange import exchange_bytes, resolve_exchange, scan_from_cp

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
