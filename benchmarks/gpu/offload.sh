#!/usr/bin/env bash
# Offload engine on a GPU (issue 4): correctness on CUDA streams, then step time with and without
# async prefetch, MFU and peak HBM, up to the largest model the device machine's 128 GiB host holds
# (14 B/param of host state: 4.5 B params use ~63 GB; building it takes 4 B/param more, briefly).
# Budget: under 8 minutes in all. Results land under $OUT:
#   offload_env.log            torch / GPU / CPU facts
#   offload_cuda_tests.log     pytest of the engine on CUDA vs resident AdamW (with injected delays)
#   mid/offload.json           1.5 B-param DiT3D (16 blocks, hidden 2048, 4096 tokens): resident vs
#                              offloaded vs offloaded without prefetch; plus the CPU AdamW kernels
#   large_prefetch/offload.json, large_noprefetch/offload.json
#                              4.5 B params (12 blocks, hidden 4096, 16384 tokens), one engine each
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

# 1. Correctness on real streams and events (~30 s).
timeout 120 $PY -m pytest -q tests/offload/test_offload_cuda.py 2>&1 | tee "$OUT/offload_cuda_tests.log"

# 2. A mid-size model, all runners side by side, and the CPU AdamW kernels with 8 threads (~2 min).
timeout 150 $PY benchmarks/offload.py --device cuda --dtype bfloat16 --hidden 2048 --depth 16 --heads 16 \
  --batch 1 --latent 16x32x32 --repeats 3 --steps-per-round 2 --peak-tflops 989 \
  --runners resident "resident, fused AdamW" offloaded "offloaded, no prefetch" --params 256e6 --optimizer-threads 8 \
  --out "$OUT/mid" 2>&1 | tee -a "$LOG"

# 3. The largest model the host holds, one engine per process (~2 min each).
for mode in "offloaded:large_prefetch" "offloaded, no prefetch:large_noprefetch"; do
  timeout 150 $PY benchmarks/offload.py --device cuda --dtype bfloat16 --hidden 4096 --depth 12 --heads 32 \
    --batch 1 --latent 16x64x64 --repeats 2 --steps-per-round 1 --peak-tflops 989 --skip optimizer \
    --runners "${mode%%:*}" --out "$OUT/${mode##*:}" 2>&1 | tee -a "$LOG"
done
echo "done: $OUT"
