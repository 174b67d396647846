#!/usr/bin/env bash
# Offload engine on a GPU (issues 4 and 11): correctness on CUDA streams (full streaming, resident
# blocks, lean host state, pageable fallback), then step time against the fastest resident run per
# host-state mode, the CPU AdamW kernels against their floors with 8 threads, and one large model
# in the leanest mode. Budget: under 8 minutes in all. Results land under $OUT:
#   offload_env.log            torch / GPU / CPU facts
#   offload_cuda_tests.log     pytest of the engine on CUDA vs resident AdamW (injected delays, lean
#                              modes, resident blocks, pin budget 0)
#   mid/offload.json           1.5 B-param DiT3D (16 blocks, hidden 2048, 4096 tokens, bf16): resident
#                              (single-tensor / fused AdamW) vs offloaded (fp32 state, bf16 master + int8
#                              moments, 4 resident blocks, no prefetch); the CPU AdamW kernels, 8 threads
#   large_lean/offload.json    4.5 B params (12 blocks, hidden 4096, 16384 tokens) with bf16 master +
#                              int8 moments: ~4 B/param of host state (18 GB instead of 63 GB)
#   offload_bench.log          every table as text
# The paper's figures to put beside them: 61% MFU with async prefetch, 28% without, 15% with the
# optimizer on the GPU, 2.11x forward speed-up from async streaming at 28 B.
# Usage: OUT=/some/dir [PYTHON=python] bash benchmarks/gpu/offload.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"
LOG="$OUT/offload_bench.log"

$PY -c 'import torch, os; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name(), os.cpu_count(), "cores")' \
  2>&1 | tee "$OUT/offload_env.log" || exit 1
free -g >> "$OUT/offload_env.log" 2>&1

# 1. Correctness on real streams, events and page-locked memory (~1 min).
timeout 150 $PY -m pytest -q tests/offload/test_offload_cuda.py 2>&1 | tee "$OUT/offload_cuda_tests.log"

# 2. A mid-size model, the runners side by side, and the CPU AdamW kernels with 8 threads (~3 min).
timeout 210 $PY benchmarks/offload.py --device cuda --dtype bfloat16 --hidden 2048 --depth 16 --heads 16 \
  --batch 1 --latent 16x32x32 --repeats 3 --steps-per-round 2 --peak-tflops 989 --skip residency \
  --runners resident "resident, fused AdamW" offloaded "offloaded, bf16 master + int8" "offloaded, 4 resident blocks" \
  "offloaded, no prefetch" --params 256e6 --optimizer-threads 8 --out "$OUT/mid" 2>&1 | tee -a "$LOG"

# 3. The large model in the leanest mode, one engine (~2 min).
timeout 150 $PY benchmarks/offload.py --device cuda --dtype bfloat16 --hidden 4096 --depth 12 --heads 32 \
  --batch 1 --latent 16x64x64 --repeats 2 --steps-per-round 1 --peak-tflops 989 --skip optimizer residency \
  --runners "offloaded, bf16 master + int8" --out "$OUT/large_lean" 2>&1 | tee -a "$LOG"
echo "done: $OUT"
