"""Precision of the GatedDeltaNet decay gate under a bf16 FSDP2 policy: ours vs Accelerate's.

    python benchmarks/gate_precision.py [--seq 4096] [--world-size 2] [--seeds 0 1 2 3 4 5 6 7]

One GatedDeltaNet layer (Transformers init: A_log = log U(0.01, 16), dt_bias = 1), bf16
compute policy with fp32 reduction, sharded over a local gloo world:
- ours: `install_fp32_gate` + `fully_shard_by_dtype` (the gate holder is an fp32 unit);
- Accelerate's approach: every parameter upcast to fp32, one unit, one bf16 policy
  (what `fsdp2_prepare_model` does for mixed-dtype models), so `A_log`/`dt_bias` are
  gathered in bf16.
Reported per approach and seed (seed s: the layer's init under `torch.manual_seed(s)`,
the input from seed s + 1), on rank 0:
- g: max over elements of |g - g_ref| / |g_ref|, where g_ref applies the fp32 formula to
  the fp32 master `A_log`/`dt_bias` and the *same* `a` the layer computed (isolates the
  gate parameters' precision);
- output: max |out - out_ref| / max |out_ref| against the whole layer in fp32 (no policy);
- decay over the sequence: max relative error of the cumulative log-decay sum(g).
Then the spread over the seeds (min / median / max) of each. Precision does not depend on
timing: the load of the machine does not matter here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import _report

APPROACHES = ("qwen35_accel (fp32 gate unit)", "Accelerate (upcast + one bf16 policy)")
METRICS = ("g", "cumulative decay sum(g)", "layer output")


def _config(seq: int, hidden: int):
    from qwen35_accel.testing.tiny import tiny_text_config

    return tiny_text_config(
        hidden_size=hidden, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, num_hidden_layers=1, layer_types=["linear_attention"], max_position_embeddings=seq,
    )


def _gate(A_log: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias)


def _errors(seed: int, seq: int, hidden: int, mesh) -> dict[str, tuple[float, float, float]]:
    """approach -> (g, cumulative decay, layer output) max relative errors for one seed."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from qwen35_accel.model.fp32_gate import GateInput, install_fp32_gate
    from qwen35_accel.parallel.fsdp import fully_shard_by_dtype

    torch.manual_seed(seed)
    reference = hf.Qwen3_5GatedDeltaNet(_config(seq, hidden), layer_idx=0)  # Transformers' gate init
    A_log_fp32, dt_bias_fp32 = reference.A_log.detach().clone(), reference.dt_bias.detach().clone()
    x = torch.randn(1, seq, hidden, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        out_ref = reference(x)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    captured: dict[str, dict[str, torch.Tensor]] = {name: {} for name in APPROACHES}

    ours = copy.deepcopy(reference)
    install_fp32_gate(ours)
    fully_shard_by_dtype(ours, mesh=mesh, mp_policy=policy)

    def capture_holder(module, args, g):
        # The holder receives the layer's `a` wrapped in a GateInput (see fp32_gate.GateInput).
        a = args[0].a if isinstance(args[0], GateInput) else args[0]
        captured[APPROACHES[0]].update(a=a, g=g)

    ours._fp32_params.register_forward_hook(capture_holder)

    theirs = copy.deepcopy(reference)  # already fp32 everywhere: the upcast is a no-op here
    fully_shard(theirs, mesh=mesh, mp_policy=policy)

    def capture_a(module, args, a):
        # The unmodified forward computes g inline from the gathered (bf16) parameters.
        captured[APPROACHES[1]].update(a=a, g=_gate(theirs.A_log, theirs.dt_bias, a))

    theirs.in_proj_a.register_forward_hook(capture_a)

    errors = {}
    with torch.no_grad():
        for name, layer in zip(APPROACHES, (ours, theirs)):
            out = layer(x).float()
            c = captured[name]
            g_ref = _gate(A_log_fp32, dt_bias_fp32, c["a"])
            g_err = ((c["g"] - g_ref).abs() / g_ref.abs()).max().item()
            cum, cum_ref = c["g"].double().cumsum(1), g_ref.double().cumsum(1)
            decay_err = ((cum - cum_ref).abs() / cum_ref.abs()).max().item()
            out_err = ((out - out_ref).abs().max() / out_ref.abs().max()).item()
            errors[name] = (g_err, decay_err, out_err)
    return errors


def _worker(rank: int, world: int, seq: int, hidden: int, seeds: list[int], out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    per_seed = {seed: _errors(seed, seq, hidden, mesh) for seed in seeds}
    if rank == 0:
        Path(out_path).write_text(json.dumps(per_seed))


def report(per_seed: dict[str, dict[str, list[float]]], seq: int, hidden: int, world: int) -> str:
    seeds = list(per_seed)
    lines = [
        f"One GatedDeltaNet layer (hidden {hidden}, Transformers init), seq {seq}, world {world}, bf16 compute / fp32 reduce; "
        f"max relative errors against fp32, seeds {' '.join(seeds)}.\n",
        "| seed | approach | " + " | ".join(METRICS) + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for seed in seeds:
        for name in APPROACHES:
            lines.append(f"| {seed} | {name} | " + " | ".join(f"{e:.2e}" for e in per_seed[seed][name]) + " |")
    lines += [
        f"\nSpread over the {len(seeds)} seeds (min / median / max):\n",
        "| approach | " + " | ".join(METRICS) + " |",
        "|---|" + "---|" * len(METRICS),
    ]
    for name in APPROACHES:
        cells = []
        for i in range(len(METRICS)):
            values = [per_seed[seed][name][i] for seed in seeds]
            cells.append(f"{min(values):.2e} / {statistics.median(values):.2e} / {max(values):.2e}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    _report.add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.hidden = 64, 64
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from qwen35_accel.testing.local_world import run_local_world

    run = _report.Run()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gate_precision.json")
        run_local_world(_worker, args.world_size, args.seq, args.hidden, args.seeds, path)
        per_seed = json.loads(Path(path).read_text())
    table = report(per_seed, args.seq, args.hidden, args.world_size)
    print(table)
    run.write(_report.results_dir(args), "gate_precision.md", "Decay-gate precision under a bf16 FSDP2 policy", table)
    worst = max(errors[APPROACHES[0]][0] for errors in per_seed.values())
    assert worst == 0.0, f"ours must give g error 0, got {worst}"


if __name__ == "__main__":
    main()
