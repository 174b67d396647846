#!/usr/bin/env bash
# An fp8 frozen base on a GPU (lora.base_dtype=float8_e4m3fn): the engine's CUDA path (codes uploaded on
# the copy stream, decoded into the slot on the compute stream) against resident training of the
# dequantised base, then the quality run of benchmarks/fp8_base.py on the GPU. Budget: under 8 minutes
# (the timeouts add up to 420 s). Results land under $OUT:
#   fp8_env.log          torch / GPU
#   fp8_check.log        losses of the engine and of the reference, 6 steps, fp32 compute; "max relative
#                        difference" should be ~1e-6 (CUDA's own reduction order), not ~1e-2
#   fp8_base/fp8_base.json, fp8_base.png, fp8_base.log   the bf16-base and fp8-base loss curves
# Usage: OUT=/some/dir [PYTHON=python] bash benchmarks/gpu/fp8_base.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"

$PY -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' \
  2>&1 | tee "$OUT/fp8_env.log" || exit 1

timeout 120 $PY - <<'PY' 2>&1 | tee "$OUT/fp8_check.log"
import sys, torch
sys.path.insert(0, "tests/offload")
from peft import LoraConfig, get_peft_model
from test_offload_frozen import _model, _loss
from slidefusion.offload import OffloadEngine, OffloadPolicy
from slidefusion.offload.engine.fp8 import dequantise, quantise
from slidefusion.optim import OptimConfig

def lora():
    torch.manual_seed(1)
    return get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj", "fc1", "fc2"],
                                               init_lora_weights=False)).get_base_model()

optim = OptimConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=None, warmup_steps=0, ema_decay=None)
model, reference = lora(), lora().cuda()
with torch.no_grad():
    for _, p in reference.named_parameters():
        if not p.requires_grad:
            codes, scales = quantise(p, torch.float8_e4m3fn, "channel")
            p.copy_(dequantise(codes, scales, tuple(p.shape), torch.float32))
engine = OffloadEngine(model, model.blocks, OffloadPolicy(device="cuda", compute_dtype=torch.float32, optim=optim,
                                                          frozen_dtype=torch.float8_e4m3fn))
opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)
ours, theirs = [], []
for step in range(6):
    def loss(m, s=step):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(2, 3, 2, 4, 4, generator=g).cuda()
        return (m(x, torch.rand(2, generator=g).cuda(), torch.randn(2, 5, 16, generator=g).cuda()) - x.flip(0)).pow(2).mean()
    ours.append(engine.train_step(loss))
    opt.zero_grad(); value = loss(reference); value.backward(); opt.step(); theirs.append(value.item())
print("engine   ", ours)
print("reference", theirs)
print("max relative difference", max(abs(a - b) / abs(b) for a, b in zip(ours, theirs)))
print("frozen bytes per parameter", engine.stats.frozen_bytes_per_param)
PY

timeout 300 $PY benchmarks/fp8_base.py --device cuda --steps 300 --tail 100 --batch 8 --out "$OUT/fp8_base" 2>&1 \
  | tee "$OUT/fp8_base.log"
