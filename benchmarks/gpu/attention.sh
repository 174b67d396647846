#!/usr/bin/env bash
# Slide attention on a GPU (issues 3 and 14): check the compiled Triton kernels against the
# reference, time them against SDPA (FlashAttention in bf16), Swin windows and the tiled PyTorch
# path at video token grids up to 30x48x80, then the joint (text + video) op: slide window plus
# 226 global keys under one softmax, timed and compared with the float64 reference. Budget: under
# 8 minutes in all (the timeouts add up to 450 s). Results land under $OUT:
#   attention_env.log            torch / triton / GPU
#   attention_triton_tests.log   pytest of the Triton forward/backward (LSE, extra keys) vs the reference, compiled
#   attention/attention.json     timings at offsets of +-0.9 and +-1.5 tokens, peak memory, machine facts (+ .png)
#   attention_bench.log          the same table as text
#   attention_joint/attention.json  joint op timings and "joint_error": max errors of out, dq, dk, dv,
#                                doffsets, dextra_k, dextra_v (relative to each one's max) on 512 random
#                                queries of 30x48x80, bf16, against float64;  attention_joint.log
# Usage: OUT=/some/dir [PYTHON=python] bash benchmarks/gpu/attention.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export TRITON_INTERPRET=0  # compiled kernels on the GPU, not the CPU interpreter

$PY -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' \
  2>&1 | tee "$OUT/attention_env.log" || exit 1

# 1. Correctness of the compiled kernels (the same tests the CPU suite runs under the interpreter).
timeout 100 $PY -m pytest -q tests/attention/test_slide_triton.py 2>&1 | tee "$OUT/attention_triton_tests.log"

# 2. Timings: B=1, 16 heads of 64, window 3x7x7, bf16. The dense baseline is SDPA at every grid.
timeout 220 $PY benchmarks/attention.py --device cuda --dtype bfloat16 --heads 16 --head-dim 64 \
  --grids 8x24x40 16x32x48 30x48x80 --offset-scales 0.9 1.5 --repeats 5 --out "$OUT/attention" 2>&1 \
  | tee "$OUT/attention_bench.log"

# 3. Joint attention at 30x48x80: per-sample slide alone and with 226 extra keys (a tenth masked),
#    forward and forward+backward, and the error against the float64 reference on 512 queries.
timeout 130 $PY benchmarks/attention.py --device cuda --dtype bfloat16 --heads 16 --head-dim 64 \
  --grids 30x48x80 --ops dense slide-sample slide-joint --offset-scales 1.5 --extra-keys 226 \
  --check-joint 512 --repeats 5 --out "$OUT/attention_joint" 2>&1 | tee "$OUT/attention_joint.log"
