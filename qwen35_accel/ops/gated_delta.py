"""The gated delta rule in plain torch: a sequence chunk as an affine map of its state.

Per value head the recurrent state S ([k_dim, v_dim]) evolves token by token by an affine
map, S_t = A_t S_{t-1} + B_t, so a whole chunk of tokens is one affine map too:

    S_out = M @ S_in + U,        o_t = o0_t + w_t @ S_in

with M [k_dim, k_dim], U [k_dim, v_dim], o0_t the chunk's output from a zero state and
w_t [k_dim] the query read through the chunk's transitions. All four come from one run
of the chunked kernel with values `[v | 0]` and initial state `[0 | I]` (the state's last
k_dim columns then track the transition product, the first v_dim the zero-state update).
Nothing here communicates; context parallelism combines the summaries of chunks held by
different ranks (`qwen35_accel.parallel.context_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import kernels

# The chunked gated delta rule, called as Transformers' `torch_chunk_gated_delta_rule` and
# FLA's `chunk_gated_delta_rule` both are: kernel(query, key, value, g=, beta=,
# initial_state=, output_final_state=True, use_qk_l2norm_in_kernel=) -> (output, final state).
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def torch_kernel() -> Kernel:
    """Transformers' chunked rule in plain torch (any device; differentiable; fp32 inside).

    Transformers decorates `torch_chunk_gated_delta_rule` so that it calls FLA's kernel when
    `fla` is importable, whatever the device; this is the torch function underneath.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    return kernels.unwrap_function(hf.torch_chunk_gated_delta_rule)


def fla_kernel() -> Kernel | None:
    """FLA's `chunk_gated_delta_rule` (Triton, CUDA tensors only) where `kernels.fla_status()`
    finds it usable (installed, importable, >= `kernels.MIN_FLA`, backward runnable), else None."""
    return kernels.fla_status().function


def select_kernel(device: torch.device) -> Kernel:
    """The kernel for tensors on `device`: FLA's where it takes them (`kernels.takes_kernel`:
    CUDA) and is usable, else `torch_kernel()` (on CUDA with a warning, once per process,
    naming why).

    Tests reach the FLA branch on CPU through Triton's interpreter
    (`qwen35_accel.testing.interpreted_kernels`); `benchmarks/cuda_check.py` compares the two
    on a GPU.
    """
    if kernels.takes_kernel("fla", device) and (fla := fla_kernel()) is not None:
        return fla
    if device.type == "cuda":
        kernels.warn_torch_fallback("gated_delta")
    return torch_kernel()


def chunk_summary(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
    kernel: Kernel | None = None,
    input_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affine summary of one chunk of the gated delta rule, in fp32.

    Args: `query`, `key` [batch, seq, k_heads, k_dim]; `value` [batch, seq, v_heads, v_dim]
    (v_heads a multiple of k_heads: GQA); `g` (log decay, ≤ 0) and `beta`
    [batch, seq, v_heads]. Any float dtype. `kernel` (see `Kernel`; default
    `torch_kernel()`) runs once, on values `[v | 0]` from the state `[0 | I]`; it gets
    query, key and values in `input_dtype` (fp32 by default; the torch kernel computes in
    fp32 whatever it gets, FLA's in its inputs' dtype with fp32 accumulation), `g`, `beta`
    and the state in fp32.
    Returns `(o0, w, M, U)`: o0 [batch, seq, v_heads, v_dim], w [batch, seq, v_heads,
    k_dim], M [batch, v_heads, k_dim, k_dim], U [batch, v_heads, k_dim, v_dim].
    """
    kernel = kernel or torch_kernel()
    batch, _, v_heads, v_dim = value.shape
    k_dim = key.shape[-1]
    f32 = torch.float32
    zeros_v = value.new_zeros(*value.shape[:-1], k_dim, dtype=input_dtype)
    augmented_value = torch.cat([value.to(input_dtype), zeros_v], dim=-1)
    eye = torch.eye(k_dim, dtype=f32, device=value.device).expand(batch, v_heads, k_dim, k_dim)
    initial = torch.cat([value.new_zeros(batch, v_heads, k_dim, v_dim, dtype=f32), eye], dim=-1)
    out, final = kernel(
        query.to(input_dtype),
        key.to(input_dtype),
        augmented_value,
        g=g.to(f32),
        beta=beta.to(f32),
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    o0, w = out.float().split([v_dim, k_dim], dim=-1)
    U, M = final.float().split([v_dim, k_dim], dim=-1)
    return o0, w, M, U


def read_state(o0: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Chunk output for incoming `state` [batch, v_heads, k_dim, v_dim]: o0 + w @ state."""
    return o0 + torch.einsum("bthk,bhkv->bthv", w, state)


def fold_states(
    transitions: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], initial: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """States entering each chunk: S_0 = initial (or 0), S_{c+1} = M_c @ S_c + U_c.

    `transitions[c]` = M_c [batch, v_heads, k_dim, k_dim], `updates[c]` = U_c
    [batch, v_heads, k_dim, v_dim], in sequence order. Returns n+1 states (the last is the
    state after the final chunk).
    """
    state = torch.zeros_like(updates[0]) if initial is None else initial.to(updates[0])
    states = [state]
    for M, U in zip(transitions, updates):
        state = M @ state + U
        states.append(state)
    return states
