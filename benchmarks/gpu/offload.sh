#!/usr/bin/env bash
# Offload engine on a GPU (issues 4 and 11): correctness on CUDA streams (full streaming, resident
# blocks, lean host state, pageable fallback), then step time against the fastest resident run per
# host-state mode, the CPU AdamW kernels against their floors with 8 threads, one large model
# in the leanest mode, a Wan 2.1 1.3B row (issue 10), tiles and spill (issue 12). Budget: about 14 minutes
# in all (each step under its own timeout; STEPS=123 or STEPS=45 runs some of them, to stay within 8). Results land under $OUT:
#   offload_env.log            torch / GPU / CPU facts
#   offload_cuda_tests.log     pytest of the engine on CUDA vs resident AdamW (injected delays, lean
#                              modes, resident blocks, pin budget 0)
#   mid/offload.json           1.5 B-param DiT3D (16 blocks, hidden 2048, 4096 tokens, bf16): resident
#                              (single-tensor / fused AdamW) vs offloaded (fp32 state, bf16 master + int8
#                              moments, 4 resident blocks, no prefetch); the CPU AdamW kernels, 8 threads
#   large_lean/offload.json    4.5 B params (12 blocks, hidden 4096, 16384 tokens) with bf16 master +
#                              int8 moments: ~4 B/param of host state (18 GB instead of 63 GB)
#   wan/offload.json           issue 10's Wan row at Wan 2.1 1.3B's exact shape (diffusers
#                              WanTransformer3DModel, 1.42 B params, 30 blocks, random weights; one 81-frame
#                              480x832 clip = 32,760 tokens, 512 text tokens, bf16): the engine (fp32 host
#                              state) against the faster of torch AdamW foreach / fused on the resident
#                              model, and peft LoRA rank 16 offloaded vs resident. The largest Wan whose
#                              resident anchor fits one GPU (14B would need ~230 GB resident); ~4 min.
#   tiling/tiling.json         issue 12: dit3d-small with slide attention at 16, 32, 64, 128 latent
#                              frames of 16x16 tokens, whole blocks vs tiled (8 frames) vs tiled +
#                              every checkpoint spilled to $SPILL (default $OUT/spill); the device
#                              peak is torch.cuda.max_memory_allocated; the disk's own bandwidth
#   offload_bench.log          every table as text
# The paper's figures to put beside them: 61% MFU with async prefetch, 28% without, 15% with the
# optimizer on the GPU, 2.11x forward speed-up from async streaming at 28 B.
# Usage: OUT=/some/dir [PYTHON=python] [STEPS=12345] bash benchmarks/gpu/offload.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python}
STEPS=${STEPS:-12345}
step() { [[ $STEPS == *$1* ]]; }
mkdir -p "$OUT"
LOG="$OUT/offload_bench.log"

$PY -c 'import torch, os; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name(), os.cpu_count(), "cores")' \
  2>&1 | tee "$OUT/offload_env.log" || exit 1
free -g >> "$OUT/offload_env.log" 2>&1

# 1. Correctness on real streams, events and page-locked memory (~1 min).
step 1 && timeout 150 $PY -m pytest -q tests/offload/test_offload_cuda.py 2>&1 | tee "$OUT/offload_cuda_tests.log"

# 2. A mid-size model, the runners side by side, and the CPU AdamW kernels with 8 threads (~3 min).
step 2 && timeout 210 $PY benchmarks/offload.py --device cuda --dtype bfloat16 --hidden 2048 --depth 16 --heads 16 \
  --batch 1 --latent 16x32x32 --repeats 3 --steps-per-round 2 --peak-tflops 989 --skip residency \
  --runners resident "resident, fused AdamW" offloaded "offloaded, bf16 master + int8" "offloaded, 4 resident blocks" \
  "offloaded, no prefetch" --params 256e6 --optimizer-threads 8 --out "$OUT/mid" 2>&1 | tee -a "$LOG"

# 3. The large model in the leanest mode, one engine (~2 min).
step 3 && timeout 150 $PY benchmarks/offload.py --device cuda --dtype bfloat16 --hidden 4096 --depth 12 --heads 32 \
  --batch 1 --latent 16x64x64 --repeats 2 --steps-per-round 1 --peak-tflops 989 --skip optimizer residency \
  --runners "offloaded, bf16 master + int8" --out "$OUT/large_lean" 2>&1 | tee -a "$LOG"

# 4. Wan 2.1 1.3B (issue 10): full fine-tune and LoRA, offloaded vs the fastest resident AdamW (~4 min).
step 4 && timeout 300 $PY benchmarks/offload.py --device cuda --dtype bfloat16 --skip step residency optimizer \
  --wan-dim 1536 --wan-head-dim 128 --wan-depth 30 --wan-ffn 8960 --wan-text-dim 4096 --wan-text-len 512 \
  --wan-latent 21x60x104 --batch 1 --lora-rank 16 --wan-adamw foreach fused --repeats 2 --steps-per-round 1 \
  --peak-tflops 989 --out "$OUT/wan" 2>&1 | tee -a "$LOG"

# 5. Tiled blocks and spilled checkpoints (issue 12): exactness on the device, then the device peak
#    against clip length (~2 min).
if step 5; then
  timeout 120 $PY -m pytest -q tests/offload/test_offload_cuda.py -k tiles 2>&1 | tee -a "$OUT/offload_cuda_tests.log"
  SPILL=${SPILL:-$OUT/spill}
  mkdir -p "$SPILL"
  timeout 240 $PY benchmarks/tiling.py --device cuda --frames 16 32 64 128 --size 64 --tile 8 --steps 1 --rounds 1 \
    --spill-dir "$SPILL" --disk-mb 2048 --out "$OUT/tiling" 2>&1 | tee -a "$LOG"
  rmdir "$SPILL" 2>/dev/null
fi
echo "done: $OUT"
