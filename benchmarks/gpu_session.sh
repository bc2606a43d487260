#!/usr/bin/env bash
# The GPU measurements still owed (FLA inside CP, the GPU step with plan's predicted memory beside
# the measured peak, the loss path's time and memory at Qwen3.5's vocabulary) in one device call,
# sized for a 15-minute device budget (about 2 minutes of it to start the machine): the checks'
# own timeouts add up to 540 s, most important first, under one 600 s command.
#
#   bash benchmarks/gpu_session.sh fetch   # here, where pip reaches an index: the wheels into .whl/ (git-ignored)
#   bash benchmarks/gpu_session.sh run     # there: the device tool's run, carry [".whl"], timeout_s 590
#   bash benchmarks/gpu_session.sh run2    # there, only if device time is left: the 9B-shaped step
#
# The GPU image (see the device tool's KINDS.md) has torch 2.11 (supported), Transformers 5.17
# (qwen35_accel needs 5.24) and no flash-linear-attention: the carried wheels are
# transformers 5.24.0, fla-core / flash-linear-attention 0.5.2 (pure Python, Triton kernels
# compiled on first use) and regex (Transformers 5.24 checks its version at import).
# causal-conv1d publishes no wheels and compiles for minutes, so the conv kernels stay
# unmeasured. Results go to $OUT (cuda_check.json, gpu_step.md, loss_memory_cuda_bf16*.md, the logs); copy them into
# benchmarks/results/ and quote them in docs/measurements.md.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl

case "${1:-}" in
fetch)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" transformers==5.24.0 fla-core==0.5.2 flash-linear-attention==0.5.2 regex==2026.5.9
    du -sh "$WHEELS"
    ;;
run)
    OUT=${OUT:-$PWD/gpu_session_out}
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    python3 -c "import torch, transformers, fla, qwen35_accel; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'fla', getattr(fla, '__version__', '?'), 'qwen35_accel', qwen35_accel.__file__)" 2>&1 \
        | tee -a "$OUT/gpu.txt" || echo "the version probe failed (above); the checks report which kernels they found"
    # 1. Correctness on the device, FLA's kernels included (check 7: the CP kernel interfaces).
    timeout 150 python3 benchmarks/cuda_check.py --out "$OUT" > "$OUT/cuda_check.log" 2>&1 || echo "cuda_check exited $?"
    tail -c 3000 "$OUT/cuda_check.log"
    # 2. The step, 2B-shaped at 8k and 32k: plan's predicted peak beside max_memory_allocated.
    timeout 240 python3 benchmarks/gpu_step.py --models 2B --seqs 8192 32768 --steps 3 --warmup 1 --budget 120 \
        --timeout 110 --results-dir "$OUT" > "$OUT/gpu_step.log" 2>&1 || echo "gpu_step (2B) exited $?"
    # 3. The loss path in bf16: tiled (hold, recompute) vs Transformers' loss, time and memory, at
    # the default tile (256 MiB of fp32 logits) and at 1 GiB: each tile adds its weight gradient
    # to an fp32 accumulator, V x H x 12 bytes of memory traffic per tile, which a GPU may feel.
    timeout 80 python3 benchmarks/loss_memory.py --device cuda --dtype bf16 --hidden 4096 --tokens 16384 \
        --steps 3 --results-dir "$OUT" > "$OUT/loss_memory.log" 2>&1 || echo "loss_memory exited $?"
    timeout 70 python3 benchmarks/loss_memory.py --device cuda --dtype bf16 --hidden 4096 --tokens 16384 \
        --tile-bytes 1073741824 --steps 3 --results-dir "$OUT" >> "$OUT/loss_memory.log" 2>&1 || echo "loss_memory (1 GiB tiles) exited $?"
    grep '^|' "$OUT/loss_memory.log" | head -16 || tail -c 2000 "$OUT/loss_memory.log"
    grep '^|' "$OUT/gpu_step.log" || tail -c 3000 "$OUT/gpu_step.log"
    ;;
run2)
    OUT=${OUT:-$PWD/gpu_session_out}
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
    timeout 200 python3 benchmarks/gpu_step.py --models 9B --seqs 32768 --steps 3 --warmup 1 --budget 90 \
        --timeout 150 --results-dir "$OUT" > "$OUT/gpu_step_9b.log" 2>&1 || echo "gpu_step (9B) exited $?"
    grep '^|' "$OUT/gpu_step_9b.log" || tail -c 3000 "$OUT/gpu_step_9b.log"
    ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh fetch|run|run2" >&2
    exit 2
    ;;
esac
