#!/usr/bin/env bash
# Slide attention on a GPU (issue 3): check the compiled Triton kernels against the reference, then
# time them against SDPA (FlashAttention in bf16), Swin windows and the tiled PyTorch path at video
# token grids up to 30x48x80. Budget: under 8 minutes in all. Results land under $OUT:
#   attention_triton_tests.log   pytest of the Triton forward/backward vs the reference (compiled)
#   attention/attention.json     timings, peak memory, machine facts;  attention/attention.png
#   attention_bench.log          the same table as text
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
timeout 150 $PY -m pytest -q tests/attention/test_slide_triton.py 2>&1 | tee "$OUT/attention_triton_tests.log"

# 2. Timings: B=1, 16 heads of 64, window 3x7x7, bf16. The dense baseline is SDPA at every grid.
timeout 300 $PY benchmarks/attention.py --device cuda --dtype bfloat16 --heads 16 --head-dim 64 \
  --grids 8x24x40 16x32x48 30x48x80 --repeats 5 --out "$OUT/attention" 2>&1 | tee "$OUT/attention_bench.log"
