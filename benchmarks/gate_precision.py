"""Precision of the GatedDeltaNet decay gate under a bf16 FSDP2 policy: ours vs Accelerate's.

    python benchmarks/gate_precision.py [--seq 4096] [--world-size 2]

One GatedDeltaNet layer (Transformers init: A_log = log U(0.01, 16), dt_bias = 1), bf16
compute policy with fp32 reduction, sharded over a local gloo world:
- ours: `install_fp32_gate` + `fully_shard_by_dtype` (the gate holder is an fp32 unit);
- Accelerate's approach: every parameter upcast to fp32, one unit, one bf16 policy
  (what `fsdp2_prepare_model` does for mixed-dtype models), so `A_log`/`dt_bias` are
  gathered in bf16.
Reported per approach, on rank 0:
- g: max over elements of |g - g_ref| / |g_ref|, where g_ref applies the fp32 formula to
  the fp32 master `A_log`/`dt_bias` and the *same* `a` the layer computed (isolates the
  gate parameters' precision);
- output: max |out - out_ref| / max |out_ref| against the whole layer in fp32 (no policy);
- decay over the sequence: max relative error of the cumulative log-decay sum(g).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.nn.functional as F


def _config(seq: int):
    from qwen35_accel.tiny import tiny_text_config

    return tiny_text_config(
        hidden_size=256, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, num_hidden_layers=1, layer_types=["linear_attention"], max_position_embeddings=seq,
    )


def _gate(A_log: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias)


def _worker(rank: int, world: int, seq: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.parallel.fsdp import fully_shard_by_dtype

    torch.manual_seed(0)
    reference = hf.Qwen3_5GatedDeltaNet(_config(seq), layer_idx=0)  # Transformers' gate init
    A_log_fp32, dt_bias_fp32 = reference.A_log.detach().clone(), reference.dt_bias.detach().clone()
    x = torch.randn(1, seq, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out_ref = reference(x)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    captured: dict[str, dict[str, torch.Tensor]] = {"ours": {}, "accelerate": {}}

    ours = copy.deepcopy(reference)
    install_fp32_gate(ours)
    fully_shard_by_dtype(ours, mesh=mesh, mp_policy=policy)
    ours._fp32_params.register_forward_hook(lambda m, args, g: captured["ours"].update(a=args[0], g=g))

    theirs = copy.deepcopy(reference)  # already fp32 everywhere: the upcast is a no-op here
    fully_shard(theirs, mesh=mesh, mp_policy=policy)

    def capture_a(module, args, a):
        # The unmodified forward computes g inline from the gathered (bf16) parameters.
        captured["accelerate"].update(a=a, g=_gate(theirs.A_log, theirs.dt_bias, a))

    theirs.in_proj_a.register_forward_hook(capture_a)

    rows = []
    with torch.no_grad():
        for name, layer in (("qwen35_accel (fp32 gate unit)", ours), ("Accelerate (upcast + one bf16 policy)", theirs)):
            out = layer(x).float()
            c = captured["ours" if layer is ours else "accelerate"]
            g_ref = _gate(A_log_fp32, dt_bias_fp32, c["a"])
            g_err = ((c["g"] - g_ref).abs() / g_ref.abs()).max().item()
            cum, cum_ref = c["g"].double().cumsum(1), g_ref.double().cumsum(1)
            decay_err = ((cum - cum_ref).abs() / cum_ref.abs()).max().item()
            out_err = ((out - out_ref).abs().max() / out_ref.abs().max()).item()
            rows.append((name, g_err, decay_err, out_err))
    if rank == 0:
        print(f"GatedDeltaNet, seq {seq}, world {world}, bf16 compute / fp32 reduce (max relative errors vs fp32)\n")
        print("| approach | g | cumulative decay sum(g) | layer output |")
        print("|---|---|---|---|")
        for name, g_err, decay_err, out_err in rows:
            print(f"| {name} | {g_err:.2e} | {decay_err:.2e} | {out_err:.2e} |")
        assert rows[0][1] == 0.0, f"ours must give g error 0, got {rows[0][1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from qwen35_accel.local_world import run_local_world

    run_local_world(_worker, args.world_size, args.seq)


if __name__ == "__main__":
    main()
