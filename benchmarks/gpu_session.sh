#!/usr/bin/env bash
# The GPU measurements still owed (FLA inside CP, the GPU step with plan's predicted memory beside
# the measured peak, the loss path's time and memory at Qwen3.5's vocabulary; activation offload's
# peak and step time in `offload`) in one device call,
# sized for a 15-minute device budget (about 2 minutes of it to start the machine): a preflight,
# then the checks, most important first, their own timeouts adding up to 545 s under one 600 s command.
#
#   bash benchmarks/gpu_session.sh fetch   # here, where pip reaches an index: wheels into .whl/ and .whl-hopper/ (git-ignored)
#   bash benchmarks/gpu_session.sh hopper  # there, first: carry [".whl-hopper"], timeout_s 120 (tilelang, ~30 s)
#   bash benchmarks/gpu_session.sh run     # there, AT ONCE after `hopper` (a machine stays warm 30 s): carry [".whl"], timeout_s 590
#   bash benchmarks/gpu_session.sh run2    # there, only if device time is left: the 9B step, 1 GiB loss tiles, TF32 vs ieee
#   bash benchmarks/gpu_session.sh offload # there, only if device time is left: carry [".whl"], timeout_s 300: activation
#                                          # offload on/off at 32k and 64k tokens, peak memory and step time (~4 min)
#   bash benchmarks/gpu_session.sh compile # there, only if device time is left: carry [".whl"], timeout_s 300: eager vs
#                                          # inductor, Transformers' layers vs the plugin's per-layer regions (~4 min)
#   bash benchmarks/gpu_session.sh moe     # there, carry [".whl"], timeout_s 300: Qwen3.5-MoE (35B-A3B's shape, 4 layers)
#                                          # at ep 1 and ep = every GPU: tokens/s, peak memory, plan's prediction (~3 min;
#                                          # one GPU: ep 1 only, ep needs 2+)
#
# The GPU image (see the device tool's KINDS.md) has torch 2.11 (supported), Transformers 5.17
# (qwen35_accel needs 5.24), Triton 3.6 and no flash-linear-attention: `.whl` carries
# transformers 5.24.0, fla-core / flash-linear-attention 0.5.2 (pure Python, Triton kernels
# compiled on first use) and regex (Transformers 5.24 checks its version at import).
# FLA 0.5.x's gated backward raises on Hopper with Triton >= 3.4, < 3.7.1 (a Triton
# miscompilation, FLA issue #640) unless its TileLang backend runs (tilelang installed, nvcc
# usable; the image has nvcc). Triton 3.7.1's wheel (198 MB) cannot travel (64 MiB a call);
# tilelang 0.1.15 with apache-tvm-ffi, torch-c-dlpack-ext and z3's library (the wheel's other
# two copies of it and its CLI left out) is 63 MB, too much beside `.whl`: hence the `hopper`
# call before `run`, installing into the same /tmp/site. Without it (a cold machine) the
# preflight says FLA's backward would raise and qwen35_accel takes the torch kernels (reported).
# causal-conv1d publishes no wheels and compiles for minutes, so the conv kernels stay
# unmeasured. Results go to $OUT (preflight.log, cuda_check.json, gpu_step.md, loss_memory_cuda_bf16.md,
# offload_step_cuda.md, the logs);
# copy them into benchmarks/results/ and quote them in docs/measurements.md.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
HOPPER=.whl-hopper
PLATFORMS=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)

install() {  # the carried wheels of $1 into /tmp/site (kept there while the machine stays warm)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/*.whl
}

prepare() {  # every measuring call: the results folder, the carried wheels, the environment
    OUT=${OUT:-$PWD/gpu_session_out}
    mkdir -p "$OUT"
    install "$WHEELS"
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
}

case "${1:-}" in
fetch)
    python3 -m pip download --no-deps "${PLATFORMS[@]}" \
        -d "$WHEELS" transformers==5.24.0 fla-core==0.5.2 flash-linear-attention==0.5.2 regex==2026.5.9
    python3 -m pip download --no-deps "${PLATFORMS[@]}" \
        -d "$HOPPER" tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5
    tmp=$(mktemp -d)
    python3 -m pip download --no-deps "${PLATFORMS[@]}" -d "$tmp" z3-solver==4.15.4.0
    # tilelang's libraries link z3/lib/libz3.so.4.15 (RUNPATH $ORIGIN/../../z3/lib) and tilelang
    # imports z3: keep the Python files and that one library (the wheel holds it three times).
    python3 - "$tmp"/z3_solver-*.whl "$HOPPER/z3-slim.zip" <<'PY'
import sys, zipfile
src, dst = zipfile.ZipFile(sys.argv[1]), zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED)
for info in src.infolist():
    name = info.filename
    if name.startswith("z3/") and (name.endswith(".py") or name == "z3/lib/libz3.so.4.15"):
        dst.writestr(info, src.read(name))
dst.close()
PY
    rm -rf "$tmp"
    du -sh "$WHEELS" "$HOPPER"
    ;;
hopper)
    # What FLA's backward needs on Hopper with the image's Triton (see above); then `run` at once.
    install "$HOPPER"
    python3 -c "import zipfile; zipfile.ZipFile('$HOPPER/z3-slim.zip').extractall('/tmp/site')"
    ln -sf libz3.so.4.15 /tmp/site/z3/lib/libz3.so
    PYTHONPATH=/tmp/site python3 -c "import tilelang, z3; print('tilelang', tilelang.__version__, 'z3', z3.get_version_string())"
    command -v nvcc && nvcc --version | tail -1
    ;;
run)
    prepare
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    python3 -c "import torch, transformers, qwen35_accel; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'qwen35_accel', qwen35_accel.__file__)" 2>&1 | tee -a "$OUT/gpu.txt" || echo "the version probe failed (above)"
    # 0. Preflight: which kernels qwen35_accel takes here and why (as `qwen35-accel env` says), then
    # FLA's forward + backward at Qwen3.5's shapes (first call: Triton compiles and autotunes, which
    # also warms the cache for check 1). A failure here explains what the checks report.
    { python3 -m qwen35_accel.cli env 2>&1 | sed -n '/^kernels/,/^settings/p'
      timeout 75 python3 benchmarks/cuda_check.py --checks fla_preflight --out "$OUT/preflight" 2>&1 || echo "preflight exited $?"
    } > "$OUT/preflight.log"; rm -rf "$OUT/preflight"
    cat "$OUT/preflight.log"
    # 1. Correctness on the device, FLA's kernels included (check 7: the CP kernel interfaces; 8: TF32).
    timeout 150 python3 benchmarks/cuda_check.py --out "$OUT" > "$OUT/cuda_check.log" 2>&1 || echo "cuda_check exited $?"
    tail -c 3000 "$OUT/cuda_check.log"
    # 2. The step, 2B-shaped at 8k and 32k: plan's predicted peak beside max_memory_allocated.
    timeout 240 python3 benchmarks/gpu_step.py --models 2B --seqs 8192 32768 --steps 3 --warmup 1 --budget 120 \
        --timeout 110 --results-dir "$OUT" > "$OUT/gpu_step.log" 2>&1 || echo "gpu_step (2B) exited $?"
    # 3. The loss path in bf16: tiled (recompute, hold) vs Transformers' loss, time and memory, at
    # the default blocks (up to 4096 tokens x the rows whose fp32 logits fit 256 MiB; products in
    # fp32 by torch.mm(out_dtype=float32), the CUDA-only branch of tiled_blocks._product).
    timeout 80 python3 benchmarks/loss_memory.py --device cuda --dtype bf16 --hidden 4096 --tokens 16384 \
        --steps 3 --results-dir "$OUT" > "$OUT/loss_memory.log" 2>&1 || echo "loss_memory exited $?"
    grep '^|' "$OUT/loss_memory.log" | head -16 || tail -c 2000 "$OUT/loss_memory.log"
    grep '^|' "$OUT/gpu_step.log" || tail -c 3000 "$OUT/gpu_step.log"
    ;;
run2)
    prepare
    timeout 200 python3 benchmarks/gpu_step.py --models 9B --seqs 32768 --steps 3 --warmup 1 --budget 90 \
        --timeout 150 --results-dir "$OUT" > "$OUT/gpu_step_9b.log" 2>&1 || echo "gpu_step (9B) exited $?"
    grep '^|' "$OUT/gpu_step_9b.log" || tail -c 3000 "$OUT/gpu_step_9b.log"
    timeout 70 python3 benchmarks/loss_memory.py --device cuda --dtype bf16 --hidden 4096 --tokens 16384 \
        --tile-bytes 1073741824 --steps 3 --results-dir "$OUT" > "$OUT/loss_memory_1g.log" 2>&1 || echo "loss_memory (1 GiB tiles) exited $?"
    grep '^|' "$OUT/loss_memory_1g.log" | head -16 || tail -c 2000 "$OUT/loss_memory_1g.log"
    # TF32 in the CP summaries (cuda_check check 8) with fp32 dots in IEEE fp32, beside run's TF32
    # numbers: a fresh Triton cache, since compiled kernels are cached across that setting.
    TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-ieee timeout 120 python3 benchmarks/cuda_check.py \
        --checks tf32_summaries --out "$OUT/ieee" > "$OUT/tf32_ieee.log" 2>&1 || echo "tf32 (ieee) exited $?"
    grep tf32_summaries "$OUT/tf32_ieee.log" | head -8
    ;;
offload)
    prepare
    # Activation offload's side stream and prefetch (issue 39): checkpointing with and without offload,
    # one process, 8 layers of 2B-like width, bf16, at 32k and 64k tokens: peak above the model
    # (max_memory_allocated), saved bytes on the device, step time.
    timeout 270 python3 benchmarks/offload_step.py --device cuda --seqs 32768 65536 --rounds 2 --warmup 1 --steps 3 \
        --timeout 120 --results-dir "$OUT" > "$OUT/offload_step.log" 2>&1 || echo "offload_step exited $?"
    grep -E '^\||\*\*' "$OUT/offload_step.log" || tail -c 3000 "$OUT/offload_step.log"
    ;;
compile)
    prepare
    # torch.compile (issue 47): eager and inductor side by side, Transformers' layers compiled whole, the
    # plugin's per decoder layer between its FSDP2 units (as under Accelerate's dynamo_config), 2B-shaped at 8k.
    timeout 280 python3 benchmarks/gpu_step.py --models 2B --seqs 8192 --steps 3 --warmup 2 --torch_compile --budget 200 \
        --timeout 130 --results-dir "$OUT" > "$OUT/gpu_step_compile.log" 2>&1 || echo "gpu_step (compile) exited $?"
    grep '^|' "$OUT/gpu_step_compile.log" || tail -c 3000 "$OUT/gpu_step_compile.log"
    ;;
moe)
    prepare
    # Qwen3.5-MoE (issue 46): every GPU a rank over NCCL (the script starts torchrun), ep 1 against ep = world.
    timeout 280 python3 benchmarks/moe_gpu_step.py --layers 4 --seq 8192 --steps 3 --warmup 1 --timeout 270 \
        --results-dir "$OUT" > "$OUT/moe_gpu_step.log" 2>&1 || echo "moe_gpu_step exited $?"
    grep '^|' "$OUT/moe_gpu_step.log" || tail -c 3000 "$OUT/moe_gpu_step.log"
    ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh fetch|hopper|run|run2|offload|compile|moe" >&2
    exit 2
    ;;
esac
