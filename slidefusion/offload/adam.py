"""Exact AdamW on flat host buffers, one group (block) at a time.

The update is `torch.optim.AdamW`'s (decoupled weight decay, bias correction). Two kernels, both in
`adamw_kernels.c`:
  exact  bitwise equal to torch.optim.AdamW's single-tensor path. Per cache-sized chunk: a C pass
         for the moments, torch's own sqrt (it is not correctly rounded, so only torch reproduces
         it), a C pass for the weights and the compute copy.
  fast   one C pass with the IEEE square root: each buffer streams through memory once, 2 (bf16
         grad) + 3x4 read + 3x4 write + 2 (compute copy) = 28 bytes per parameter, the bandwidth
         floor. At most 1 ulp from torch per square root.
Bitwise matters for the fp32 comparison with torch: parameters whose true gradient is zero
(attention key biases) train on rounding noise, and Adam's normalisation turns a 1-ulp difference
there into a full learning-rate step. The engine uses `exact` with fp32 compute and `fast`
otherwise, where bf16 rounding of the compute copy dominates anyway. Without a C compiler both
fall back to torch operations (`adamw_reference_`, and torch's fused kernel).
The hyper-parameters come from `OptimConfig` (betas, eps, weight_decay; the learning rate is passed
per step, as the schedule moves it).
"""

from concurrent.futures import ThreadPoolExecutor
from functools import cache

import torch

from slidefusion.offload import kernels
from slidefusion.offload.transfer import serial_torch_here
from slidefusion.optim import OptimConfig

CHUNK = 1 << 18  # elements per chunk of the torch fallbacks: smaller ones pay per-call overhead
EXACT_CHUNK = 1 << 15  # 4 fp32 streams x 128 KiB: stays in a 1-2 MiB L2 between the three passes


def adamw_parallel_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    compute: torch.Tensor, step: int, lr: float, cfg: OptimConfig, grad_scale: float = 1.0,
                    exact: bool = True, threads: int = 1) -> None:
    """`adamw_` split into `threads` contiguous ranges run at once (the kernels release the GIL).

    One core cannot saturate a server's memory bandwidth; the ranges are aligned to whole chunks,
    so every element sees exactly the operations it would see in one call."""
    n = master.numel()
    parts = min(threads, max(1, n // EXACT_CHUNK))
    if parts <= 1:
        return adamw_(master, grad, exp_avg, exp_avg_sq, compute, step, lr, cfg, grad_scale, exact)
    per = -(-n // parts // EXACT_CHUNK) * EXACT_CHUNK
    run_ranges(lambda a, b: adamw_(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], compute[a:b], step, lr, cfg,
                                   grad_scale, exact), [*range(0, n, per), n], threads)


def run_ranges(fn, edges: list[int], threads: int) -> None:
    """`fn(a, z)` for every pair of neighbouring `edges`, all at once on the optimizer's pool of
    `threads` threads (one pool for every kernel); returns when all are done."""
    for job in [_pool(threads).submit(fn, a, z) for a, z in zip(edges, edges[1:])]:
        job.result()


@cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="offload-adamw", initializer=serial_torch_here)


@torch.no_grad()
def adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           compute: torch.Tensor, step: int, lr: float, cfg: OptimConfig, grad_scale: float = 1.0,
           exact: bool = True) -> None:
    """One AdamW step on flat 1-D fp32 buffers (step counts from 1); writes `compute` = master cast.

    `grad` may be in the compute dtype (upcast on the fly). `grad_scale` multiplies the gradient
    first (the clipping coefficient), as `clip_grad_norm_` does before `step()`."""
    lib = kernels.load()
    if lib is None or not {grad.dtype, compute.dtype} <= {torch.float32, torch.bfloat16}:
        if exact or not hasattr(torch, "_fused_adamw_"):
            return adamw_reference_(master, grad, exp_avg, exp_avg_sq, compute, step, lr, cfg, grad_scale)
        return _torch_fused_(master, grad, exp_avg, exp_avg_sq, compute, step, lr, cfg, grad_scale)
    beta1, beta2 = cfg.betas
    decay, w1, value2 = 1 - lr * cfg.weight_decay, 1 - beta1, 1 - beta2
    bias2_sqrt, neg_step = (1 - beta2 ** step) ** 0.5, -(lr / (1 - beta1 ** step))
    flags = {"use_decay": int(cfg.weight_decay != 0), "use_scale": int(grad_scale != 1.0)}
    g_bf16, c_bf16 = int(grad.dtype == torch.bfloat16), int(compute.dtype == torch.bfloat16)
    p, g, m, v, c = (t.data_ptr() for t in (master, grad, exp_avg, exp_avg_sq, compute))
    gs, cs, n = grad.element_size(), compute.element_size(), master.numel()
    if not exact:
        return lib.fused(p, g, g_bf16, m, v, c, c_bf16, n, decay, flags["use_decay"], grad_scale, flags["use_scale"],
                         w1, beta2, value2, bias2_sqrt, cfg.eps, neg_step)
    root = torch.empty(min(EXACT_CHUNK, n), dtype=torch.float32)
    for a in range(0, n, EXACT_CHUNK):
        k = min(EXACT_CHUNK, n - a)
        lib.moments(p + 4 * a, g + gs * a, g_bf16, m + 4 * a, v + 4 * a, k, decay, flags["use_decay"], grad_scale,
                    flags["use_scale"], w1, beta2, value2)
        torch.sqrt(exp_avg_sq[a:a + k], out=root[:k])  # still in cache from `moments`
        lib.apply(p + 4 * a, m + 4 * a, root.data_ptr(), c + cs * a, c_bf16, k, bias2_sqrt, cfg.eps, neg_step)


def _torch_fused_(master, grad, exp_avg, exp_avg_sq, compute, step, lr, cfg, grad_scale, chunk=CHUNK) -> None:
    """The fast path without a C compiler: torch's fused kernel per chunk, then the cast."""
    beta1, beta2 = cfg.betas
    steps = [torch.tensor(float(step))]
    n = master.numel()
    staging = torch.empty(min(chunk, n), dtype=torch.float32)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        g = grad[start:end]
        if g.dtype != torch.float32 or grad_scale != 1.0:  # never scale the caller's buffer in place
            g = staging[:end - start].copy_(g)
            if grad_scale != 1.0:
                g.mul_(grad_scale)
        torch._fused_adamw_([master[start:end]], [g], [exp_avg[start:end]], [exp_avg_sq[start:end]], [], steps,
                            lr=lr, beta1=beta1, beta2=beta2, weight_decay=cfg.weight_decay, eps=cfg.eps,
                            amsgrad=False, maximize=False)
        compute[start:end].copy_(master[start:end])


@torch.no_grad()
def adamw_reference_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           compute: torch.Tensor, step: int, lr: float, cfg: OptimConfig, grad_scale: float = 1.0,
           chunk: int = CHUNK) -> None:
    """`adamw_` as torch.optim.AdamW's single-tensor code, op by op (the specification)."""
    beta1, beta2 = cfg.betas
    step_size = lr / (1 - beta1 ** step)
    bias2_sqrt = (1 - beta2 ** step) ** 0.5
    decay = 1 - lr * cfg.weight_decay
    n = master.numel()
    scratch = torch.empty(min(chunk, n), dtype=torch.float32)
    g32 = torch.empty(min(chunk, n), dtype=torch.float32)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        p, m, v = master[start:end], exp_avg[start:end], exp_avg_sq[start:end]
        g = g32[:end - start].copy_(grad[start:end])
        if grad_scale != 1.0:
            g.mul_(grad_scale)
        if cfg.weight_decay != 0:
            p.mul_(decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = torch.sqrt(v, out=scratch[:end - start]).div_(bias2_sqrt).add_(cfg.eps)
        p.addcdiv_(m, denom, value=-step_size)
        compute[start:end].copy_(p)


@torch.no_grad()
def parameter_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 2-norm of each parameter's gradient, as `clip_grad_norm_` takes them."""
    return [torch.linalg.vector_norm(g if g.dtype == torch.float32 else g.float()) for g in grads]


@torch.no_grad()
def clip_coefficient(norms: list[torch.Tensor], max_norm: float) -> float:
    """`clip_grad_norm_`'s factor from per-parameter norms in `model.parameters()` order:
    max_norm / (total_norm + 1e-6), capped at 1, computed with the same fp32 operations."""
    total = torch.linalg.vector_norm(torch.stack(norms))
    return float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
