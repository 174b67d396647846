#!/usr/bin/env bash
# Data-parallel training on one multi-GPU node (NCCL, one rank per GPU): a torchrun smoke of
# `slidefusion train --offload` on the tiny preset (host state sharded, one shared host copy), then
# benchmarks/distributed.py: the offload engine overlapped vs plain collectives, one shared host copy
# vs one per rank, against FSDP2 + CPUOffloadPolicy on the same ranks and model. Budget: under 8
# minutes (the timeouts add up to 420 s). One GPU cannot hold two NCCL ranks: the script then says
# so in $OUT/distributed_skipped.log and exits 0. Results land under $OUT:
#   distributed_env.log            torch / GPUs
#   distributed_train.log          torchrun -m slidefusion train (tiny preset, 6 steps, bf16, --offload)
#   distributed/distributed.json   the benchmark's cases, per rank; distributed_bench.log its table
# Usage: OUT=/some/dir [PYTHON=python] [GPUS=N] bash benchmarks/gpu/distributed.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"

FOUND=$($PY -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
if [ "${FOUND:-0}" -lt 2 ]; then
  echo "distributed: skipped: data-parallel NCCL needs 2 or more GPUs on this node, found ${FOUND:-0}" \
    | tee "$OUT/distributed_skipped.log"
  exit 0
fi
N=${GPUS:-$FOUND}
$PY -c 'import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name())' \
  2>&1 | tee "$OUT/distributed_env.log"

# 1. The CLI under torchrun: every rank trains its rows, rank 0 writes.
timeout 180 $PY -m torch.distributed.run --nproc-per-node "$N" -m slidefusion train configs/tiny.yaml \
  run.device=cuda run.steps=6 run.save_every=6 run.log_every=1 "run.output_dir=$OUT/distributed_runs" \
  offload.compute_dtype=bfloat16 --offload --quiet 2>&1 | tee "$OUT/distributed_train.log"

# 2. The benchmark: real NCCL (no emulated delay), so exposed communication is plain - overlapped.
timeout 240 $PY -m torch.distributed.run --nproc-per-node "$N" benchmarks/distributed.py --device cuda \
  --gbps 1e9 --latency-us 0 --out "$OUT/distributed/distributed.json" 2>&1 | tee "$OUT/distributed_bench.log"
