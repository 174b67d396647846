#!/usr/bin/env bash
# Sliced Ulysses on a GPU (issue 13): the CUDA log-sum-exp attention (the one CUDA-only piece of the
# sliced schedule; multi-rank NCCL needs more than the one GPU a device machine lends) against the
# reference, then the simulator's scenarios for the record. Budget: under 2 minutes. Results under $OUT:
#   parallel_cuda_tests.log   pytest of attention_lse on CUDA (fp32 and bf16) vs the float64 reference
#   parallel_simulate.log     slidefusion simulate --scenario full / calibration
# Usage: OUT=/some/dir [PYTHON=python] bash benchmarks/gpu/parallel.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"
$PY -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' \
  2>&1 | tee "$OUT/parallel_env.log" || exit 1
timeout 120 $PY -m pytest -q tests/parallel/test_parallel_cuda.py 2>&1 | tee "$OUT/parallel_cuda_tests.log"
{ $PY -m slidefusion simulate --scenario full; $PY -m slidefusion simulate --scenario calibration; } \
  2>&1 | tee "$OUT/parallel_simulate.log"
