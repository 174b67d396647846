#!/usr/bin/env bash
# The parallel schedules on what one lent GPU can run (budget: under 4 minutes). Results under $OUT:
#   parallel_env.log           torch, CUDA device, GPU count
#   parallel_cuda_tests.log    pytest: the CUDA log-sum-exp attention (sliced Ulysses' and the ring's one
#                              CUDA-only piece) and its merge, fp32 and bf16, against the float64 reference
#   parallel_streams.json/.log one ring step on streams: a block's attention while the next block arrives
#                              (copy from pinned host / device on a second stream): overlap and slowdown,
#                              the simulator's `slowdown` to feed `slidefusion simulate --calibration`
#   parallel_simulate.log      slidefusion simulate --scenario full (Ulysses, sliced, ring, USP; 400 and
#                              3200 Gb/s between nodes) and --scenario calibration
# Skipped, and said so in parallel_skipped.log: everything that needs several GPUs - ring / usp / ulysses
# over NCCL (send/recv kernels take SMs, which the copy engine here does not), and the diffusers anchor
# (`benchmarks/parallel.py --anchor diffusers` on CUDA, where diffusers' ring runs too). With 2+ GPUs:
#   torchrun --nproc-per-node N -m slidefusion generate --pretrained DIR --parallel auto ...
# Usage: OUT=/some/dir [PYTHON=python] bash benchmarks/gpu/parallel.sh      DRY_RUN=1 prints the steps only.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python}
DRY_RUN=${DRY_RUN:-}
mkdir -p "$OUT"

step() {  # step LOG COMMAND...: run (or, with DRY_RUN, print) one step, its output teed to $OUT/LOG
  local log=$1
  shift
  if [ -n "$DRY_RUN" ]; then
    echo "+ $* > $OUT/$log"
  else
    "$@" 2>&1 | tee "$OUT/$log"
  fi
}

if [ -z "$DRY_RUN" ]; then
  $PY -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), "GPU(s)")' \
    2>&1 | tee "$OUT/parallel_env.log" || exit 1
fi
step parallel_cuda_tests.log timeout 120 $PY -m pytest -q tests/parallel/test_parallel_cuda.py
step parallel_streams.log timeout 120 $PY benchmarks/gpu/parallel_streams.py --out "$OUT/parallel_streams.json"
step parallel_simulate.log bash -c "$PY -m slidefusion simulate --scenario full && $PY -m slidefusion simulate --scenario full --inter-gbps 3200 && $PY -m slidefusion simulate --scenario calibration"
gpus=$([ -n "$DRY_RUN" ] && echo "?" || $PY -c 'import torch; print(torch.cuda.device_count())')
echo "skipped ($gpus GPU(s) here): NCCL ring / usp / ulysses, and diffusers' ring as an anchor, need several GPUs" \
  "and a model folder; run them with torchrun --nproc-per-node N -m slidefusion generate --pretrained DIR" \
  "--parallel auto|ring|usp ... (benchmarks/parallel.py runs its ranks on CPU with gloo)" | tee "$OUT/parallel_skipped.log"
