"""Training step on one GPU: unmodified Transformers vs qwen35_accel at cp 1 and cp 2.

    python benchmarks/gpu_step.py [--models 2B 9B] [--seqs 8192 32768 65536] [--steps 5] [--warmup 2]
                                  [--layers N] [--torch_compile] [--config-json PATH] [--budget S] [--smoke]

One prepared script for a GPU session (no downloads: random-init models of published
shapes). Per model and sequence, tokens/s, peak memory (`torch.cuda.max_memory_allocated`,
beside what `qwen35-accel plan`'s memory model predicts for our configurations) and an MFU
estimate of:

  (a) transformers   the unmodified model in one process (FLA / causal-conv1d kernels when
                     installed, as Transformers picks them), fp32 weights, bf16 autocast;
  (b) ours cp 1      `PARALLELIZER.apply` on a 1-rank mesh: dtype-uniform FSDP2 units (bf16
                     compute, fp32 gate holder, fp32 master weights and reduction);
  (c) ours cp 2      the same over a cp group of 2 ranks, both processes on the one GPU,
                     gloo (NCCL refuses two ranks on one device); the state exchange is
                     forced to the all-gather (gloo has no point-to-point for CUDA tensors).
                     Tokens/s counts the whole sequence once (so CP's extra work shows).

Every configuration: activation checkpointing per decoder layer, batch 1, SGD (no optimizer
state: a 9B model's fp32 weights and gradients are 72 GB already), `--warmup` untimed steps,
then the median of `--steps` timed steps (CUDA synchronised). `--torch_compile` adds rows
compiled with inductor: Transformers' with every decoder layer compiled (`layer.compile()`), the
plugin's per decoder layer between its FSDP2 units, as the Accelerate integration compiles them
(`parallel.regional_compile`). A configuration that runs
out of memory is reported as OOM and the run goes on; `--layers` cuts the depth (stated in
the results) when whole models do not fit.

MFU: model FLOPs per token = 6 × (matmul parameters, lm_head included) + causal attention
6 × L_attn × S × Hq × D + GatedDeltaNet state 6 × L_gdn × Hv × 4 × Dk × Dv (the chunked
rule's intra-chunk terms left out), × tokens/s, / the GPU's dense bf16 peak (`--peak-tflops`;
H100/H200: 989). `--smoke` runs tiny fp32 shapes on CPU (no MFU) and checks that the three
configurations compute the same first-step loss.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import _report

# Published shapes (model cards; text model only, no vision tower). 9B: Qwen/Qwen3.5-9B model
# card (hidden 4096, 32 layers = 8 × (3 GatedDeltaNet + 1 attention), GatedDeltaNet 16 QK /
# 32 V heads × 128, attention 16 Q / 4 KV heads × 256, FFN 12288, vocab 248320). 2B: NOT
# checked against Qwen/Qwen3.5-2B's config.json in this session; check it (or pass
# --config-json) before quoting figures.
SHAPES: dict[str, dict] = {
    "9B": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, linear_num_key_heads=16,
               linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
               num_attention_heads=16, num_key_value_heads=4, head_dim=256, vocab_size=248320,
               tie_word_embeddings=False),
    "2B": dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=6144, linear_num_key_heads=16,
               linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
               num_attention_heads=8, num_key_value_heads=2, head_dim=256, vocab_size=248320,
               tie_word_embeddings=True),
}
COMMON = dict(linear_conv_kernel_dim=4, partial_rotary_factor=0.25, max_position_embeddings=262144)
SMOKE_SHAPE = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                   tie_word_embeddings=False)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0}
CONFIGS = ("transformers", "ours cp 1", "ours cp 2")


def text_config(shape: dict, layers: int | None):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    shape = {**COMMON, **shape}
    if layers is not None:
        shape["num_hidden_layers"] = layers
    n = shape["num_hidden_layers"]
    config = Qwen3_5TextConfig(**shape, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)])
    config._attn_implementation = "sdpa"
    return config


def flops_per_token(config, seq: int) -> float:
    """Model FLOPs per trained token (forward + backward), see the module docstring."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name)
    if config.tie_word_embeddings:
        matmul += model.lm_head.weight.numel()
    n_attn = config.layer_types.count("full_attention")
    n_gdn = len(config.layer_types) - n_attn
    attention = 6 * n_attn * seq * config.num_attention_heads * config.head_dim
    state = 6 * n_gdn * config.linear_num_value_heads * 4 * config.linear_key_head_dim * config.linear_value_head_dim
    return 6 * matmul + attention + state


def predicted_bytes(config, seq: int, world: int, device_type: str, parallel=None) -> int:
    """What `qwen35-accel plan`'s memory model predicts per rank for an "ours" configuration
    of this script: FSDP2 over a cp group of `world` (or `parallel`, a `memory.Parallel`), bf16
    compute on fp32 masters (fp32 on the CPU smoke), SGD without momentum (no state),
    checkpointing, the default tiled loss."""
    import importlib.util

    from qwen35_accel.memory import ModelShape, Parallel, StepOptions, estimate

    smoke = device_type == "cpu"
    options = StepOptions(seq_len=seq, compute_bytes=4 if smoke else 2, param_bytes=4, optimizer="none",
                          activation_checkpointing=True, device=device_type,
                          fla=importlib.util.find_spec("fla") is not None)
    return estimate(ModelShape.from_config(config), parallel or Parallel(cp=world), options).total


def _worker(rank: int, world: int, name: str, config_dict: dict, seq: int, steps: int, warmup: int, compiled: bool,
            device_type: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    config = Qwen3_5TextConfig(**config_dict)
    config._attn_implementation = "sdpa"
    device = torch.device(device_type)
    smoke = device_type == "cpu"
    result: dict = {"config": name, "compiled": compiled, "rank": rank}
    try:
        torch.manual_seed(0)
        with device:
            model = Qwen3_5ForCausalLM(config)  # fp32 weights; the same on every rank and config
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(1, config.vocab_size, (1, seq), generator=gen).to(device)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if name == "transformers":
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
            autocast = torch.autocast(device_type, dtype=torch.bfloat16, enabled=not smoke)
            layers = model.model.layers
        else:
            from qwen35_accel import PARALLELIZER
            from qwen35_accel.context_parallel import shard_batch
            from qwen35_accel.parallel.context_parallel.gated_delta_net import ContextParallelGatedDeltaNet

            mesh = init_device_mesh(device_type, (1, 1, world, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            dtype = torch.float32 if smoke else torch.bfloat16
            PARALLELIZER.apply(model, mesh, activation_checkpointing=True,
                               mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
            for module in model.modules():
                if isinstance(module, ContextParallelGatedDeltaNet) and device_type == "cuda":
                    module.state_exchange = "allgather"  # gloo sends CPU tensors only
            if world > 1:
                batch = shard_batch(batch, mesh["cp"])
            autocast = torch.autocast(device_type, enabled=False)
            layers = model.model.layers
        if compiled and name == "transformers":
            for layer in layers:
                layer.compile()
        elif compiled:  # as the plugin compiles under Accelerate's dynamo_config: the regions between FSDP2 units
            from qwen35_accel.model.detect import qwen35_parts
            from qwen35_accel.parallel.regional_compile import compile_layer_regions

            compile_layer_regions(qwen35_parts(model), context_parallel=world > 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        if device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, first_loss = [], None
        for step in range(warmup + steps):
            if world > 1:
                dist.barrier()
            if device_type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device_type == "cuda":
                torch.cuda.synchronize()
            if step == 0:
                first_loss = float(loss.detach())
            if step >= warmup:
                times.append(time.perf_counter() - start)
        result.update(seconds=sorted(times)[len(times) // 2], first_loss=first_loss,
                      peak_bytes=torch.cuda.max_memory_allocated() if device_type == "cuda" else None)
    except torch.OutOfMemoryError:
        result.update(oom=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))


def _run(name: str, config, seq: int, args, compiled: bool, device_type: str) -> list[dict]:
    from qwen35_accel.testing.local_world import run_local_world

    world = 2 if name == "ours cp 2" else 1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        run_local_world(_worker, world, name, config.to_dict(), seq, args.steps, args.warmup, compiled, device_type, path,
                        threads_per_rank=args.threads, timeout=args.timeout)
        return json.loads(Path(path).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["2B", "9B"], choices=sorted(SHAPES))
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's); stated in the results")
    parser.add_argument("--torch_compile", action="store_true", help="also run every configuration with compiled decoder layers")
    parser.add_argument("--config-json", type=Path, default=None, help="a text config.json to use instead of --models' shapes")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU (default: by its name)")
    parser.add_argument("--threads", type=int, default=4, help="CPU threads per rank")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration before its world is killed")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which no further configuration starts (listed as skipped; for a device "
                             "session's fixed time)")
    _report.add_arguments(parser)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    run = _report.Run()
    if args.smoke:
        device_type, shapes, args.seqs, args.steps, args.warmup, args.threads = "cpu", {"tiny (smoke)": SMOKE_SHAPE}, [64], 2, 1, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_step.py measures a GPU; on a CPU machine run it with --smoke")
        device_type = "cuda"
        shapes = {name: SHAPES[name] for name in args.models}
        if args.config_json is not None:
            shapes = {args.config_json.parent.name or "config": json.loads(args.config_json.read_text()).get("text_config")
                      or json.loads(args.config_json.read_text())}
    peak = args.peak_tflops
    if peak is None and device_type == "cuda":
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name(0)), None)

    started = time.perf_counter()
    lines = [f"Batch 1, activation checkpointing, SGD; median of {args.steps} steps after {args.warmup} warm-up steps; "
             f"layers: {args.layers or 'all'}; MFU against {peak or 'n/a'} TFLOP/s.\n",
             "| model | seq | config | compiled | tokens/s | vs transformers | peak memory (GiB, per rank) | plan predicts (GiB) | MFU | first loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model_name, shape in shapes.items():
        known = {k: v for k, v in shape.items() if k in SMOKE_SHAPE or k in COMMON}
        config = text_config(known, args.layers)
        for seq in args.seqs:
            flops = flops_per_token(config, seq)
            for compiled in ([False, True] if args.torch_compile else [False]):
                baseline = None
                for name in CONFIGS:
                    if args.budget is not None and time.perf_counter() - started >= args.budget:
                        lines.append(f"| {model_name} | {seq} | {name} | {compiled} | skipped (--budget {args.budget:g} s) | | | | | |")
                        print(lines[-1], flush=True)
                        continue
                    ranks = _run(name, config, seq, args, compiled, device_type)
                    if any(r.get("oom") for r in ranks):
                        lines.append(f"| {model_name} | {seq} | {name} | {compiled} | OOM | | | | | |")
                        continue
                    seconds = max(r["seconds"] for r in ranks)
                    tokens = seq / seconds
                    baseline = tokens if name == "transformers" else baseline
                    ratio = f"{tokens / baseline:.3f}" if baseline else ""
                    memory = "/".join(f"{r['peak_bytes'] / 2**30:.1f}" for r in ranks) if ranks[0]["peak_bytes"] is not None else "n/a"
                    mfu = f"{tokens * flops / (peak * 1e12):.3f}" if peak else "n/a"
                    # The memory model covers our path, not Transformers' autocast one.
                    world = 2 if name == "ours cp 2" else 1
                    plan = "" if name == "transformers" else f"{predicted_bytes(config, seq, world, device_type) / 2**30:.1f}"
                    lines.append(f"| {model_name} | {seq} | {name} | {compiled} | {tokens:.1f} | {ratio} | {memory} | {plan} | {mfu} | "
                                 f"{ranks[0]['first_loss']:.6f} |")
                    print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    run.write(_report.results_dir(args), "gpu_step.md", "Training step on one GPU: Transformers vs qwen35_accel cp 1 / cp 2",
              table, append=True)


if __name__ == "__main__":
    main()
