"""`qwen35-accel`: see what a launch will do, without GPUs or weights.

    qwen35-accel plan --model PATH|tiny|tiny-vlm --config accelerate_configs/X.yaml [--seq-len N] [--backend nccl|gloo] [--json]
                      [--batch-size B] [--optimizer adamw|sgd|none] [--gpu-memory 141GB [--suggest]]
                      [--vision-tower trainable|frozen|none] [--image-tokens N] [--ref-model]
    qwen35-accel env [--json]

Argument parsing only: `plan` (the `plan` package) builds the model on the meta device and
runs the real parallelizer over a fake process group of the config's world size, then
reports the run it plans (device, backend, kernels: from the YAML, or `--backend`), the mesh, every FSDP2 unit per decoder layer, a VLM's vision tower (its units and
bytes per rank) and the context-parallel layout with its per-layer communication, and the
memory per rank of a training step (the `memory` package): whether it fits `--gpu-memory`, and
with `--suggest` the smallest cp that does; `env` (the `env` module) reports versions, the
plugin's activation, its patch points and settings.
"""

from __future__ import annotations

import argparse
import json
import sys

from .env import env, print_env
from .plan import VISION_TOWER_CHOICES, PlanError, host_memory_option, memory_options, plan, print_plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qwen35-accel", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_plan = sub.add_parser("plan", help="mesh, FSDP2 units per layer, CP layout (meta device, no GPU)")
    p_plan.add_argument("--model", required=True, help="a model directory / config.json, 'tiny' or 'tiny-vlm'")
    p_plan.add_argument("--config", required=True, help="an Accelerate YAML (accelerate_configs/…)")
    p_plan.add_argument("--seq-len", type=int, default=4096, help="sequence length for the CP traffic figures")
    p_plan.add_argument("--backend", choices=("nccl", "gloo"),
                        help="the run to plan: gloo a CPU run (torch kernels), nccl a CUDA run (FLA and causal-conv1d "
                             "assumed installed); default: the run the YAML describes (use_cpu: true: gloo, else nccl)")
    p_plan.add_argument("--json", action="store_true")
    p_plan.add_argument("--batch-size", type=int, default=1, help="sequences per rank and step (micro-batch)")
    p_plan.add_argument("--optimizer", default="adamw",
                        help="adamw (default), sgd or none: state per parameter, AdamW two moments, SGD one momentum buffer")
    p_plan.add_argument("--gpu-memory", help="memory per GPU, e.g. 141GB, 139.8GiB, 80000MB: says whether the step fits")
    p_plan.add_argument("--host-memory", help="host memory per node, e.g. 2TB: with activation offload, says whether the "
                        "node's ranks' offloaded layer inputs fit (pinned, so resident)")
    p_plan.add_argument("--suggest", action="store_true",
                        help="with --gpu-memory: the smallest cp (activation checkpointing on) that fits on the config's GPUs")
    p_plan.add_argument("--vision-tower", choices=VISION_TOWER_CHOICES,
                        help="a VLM config's vision tower: trainable (default), frozen (as the run freezes it; "
                             "QWEN35_ACCEL_FROZEN_MULTIMODAL_SHARDING says how it is held), none (the text model alone)")
    p_plan.add_argument("--image-tokens", type=int, default=0,
                        help="image and video tokens per rank's micro-batch, part of batch-size x seq-len "
                             "(the tower encodes merge^2 patches each); 0 (default): a text-only step")
    p_plan.add_argument("--ref-model", action="store_true",
                        help="the run also holds a frozen reference copy of the model (TRL's ref_model: DPO, KTO, GRPO/RLOO "
                             "with beta > 0): its parameters sharded as the policy's, no gradients, optimizer state or "
                             "activations")
    p_env = sub.add_parser("env", help="versions, plugin status, patch points, settings")
    p_env.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    if args.command == "plan":
        try:
            gpu_memory = memory_options(args.gpu_memory, args.batch_size, args.optimizer, args.suggest)
            host_memory = host_memory_option(args.host_memory)
            result = plan(args.model, args.config, args.seq_len, args.backend, batch_size=args.batch_size,
                          optimizer=args.optimizer, gpu_memory=gpu_memory, host_memory=host_memory, suggest=args.suggest,
                          vision_tower=args.vision_tower, image_tokens=args.image_tokens, reference_model=args.ref_model)
        except PlanError as error:
            print(f"qwen35-accel plan: {error}", file=sys.stderr)
            return 2
        print(json.dumps(result, indent=2)) if args.json else print_plan(result)
    else:
        result = env()
        print(json.dumps(result, indent=2, default=str)) if args.json else print_env(result)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
