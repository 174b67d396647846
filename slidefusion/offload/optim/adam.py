"""AdamW on flat host buffers, one group (block) at a time: bitwise torch.optim.AdamW(fused=True).

The update is torch's (decoupled weight decay, bias correction), in the operations and order of
torch's fused CPU kernel, the fastest resident optimizer and so the benchmark's anchor:
  body  one C pass (`adamw_kernels.c`): each buffer streams through memory once, 2 (bf16 grad)
        + 3x4 read + 3x4 write + 2 (compute copy) = 28 bytes per parameter, the bandwidth floor.
  tail  torch's vectorized loop leaves the last (numel mod vector width) elements of each tensor
        to a scalar loop that rounds the second moment differently. Those elements (past the last
        multiple of TAIL, which every vector width divides) go to torch's kernel itself.
Where the C kernel is missing, or disagrees with torch on a probe at first use (torch's
non-vectorized build rounds differently), torch's kernel does the bodies too. So it does for an
update the compute thread runs itself (`in_torch_pool`: a CPU device, not overlapped): torch's
kernel then runs on torch's own intra-op threads, already awake, where our pool would start threads
of its own beside them (`benchmarks/offload.py` measures both; results in the README). The C pass
split over those same threads through OpenMP, as the lean kernels are (`lean_update_ranges`), was
slower than torch's kernel there in A/B runs.
Bitwise matters for the comparison with a resident run: parameters whose true gradient is zero
(attention key biases) train on rounding noise, and Adam's normalisation turns a 1-ulp difference
there into a full learning-rate step. torch's default, single-tensor AdamW is not the target: it
takes its square root from MKL, 1 ulp off on a share of inputs that depends on the CPU, so matching
it needs torch.sqrt between two passes, a slower update (the README's optimizer table). The two
torch optimizers differ only there.
The hyper-parameters come from `OptimConfig` (betas, eps, weight_decay; the learning rate is passed
per step, as the schedule moves it).
"""

import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import torch

from slidefusion.offload.engine.transfer import serial_torch_here
from slidefusion.offload.optim import kernels
from slidefusion.optim import OptimConfig

CHUNK = 1 << 18  # elements per call of torch's kernel: smaller ones pay per-call overhead
TAIL = 64  # a multiple of every vector width torch's kernel uses (4 to 16 floats)
SPLIT = 1 << 15  # the fewest elements worth a thread of their own

Piece = tuple[int, int, bool]  # [start, end) of a flat buffer, and whether it is a tensor's tail


def pieces(ends: list[int]) -> list[Piece]:
    """[0, ends[-1]) as bodies and tails, for tensors laid end to end that end at `ends`:
    neighbouring bodies merge, so whole-multiple tensors make one piece."""
    out: list[Piece] = []
    start = 0
    for end in ends:
        cut = start + (end - start) // TAIL * TAIL
        if cut > start:
            if out and not out[-1][2] and out[-1][1] == start:
                out[-1] = (out[-1][0], cut, False)
            else:
                out.append((start, cut, False))
        if end > cut:
            out.append((cut, end, True))
        start = end
    return out


def adamw_parallel_(master: torch.Tensor, grad: torch.Tensor | list[torch.Tensor], exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, compute: torch.Tensor | None, step: int, lr: float, cfg: OptimConfig,
                    grad_scale: float = 1.0, ends: list[int] | None = None, threads: int = 1,
                    in_torch_pool: bool = False) -> None:
    """`adamw_` split into `threads` ranges of about equal length run at once (the kernels release
    the GIL; one core cannot saturate a server's memory bandwidth). A range edge falls inside a
    body at a multiple of TAIL from its start, never inside a tail, so every element sees exactly
    the operations it would see in one call. `grad` may also be one flat gradient per tensor.
    `in_torch_pool`: every piece on torch's kernel, which splits it over torch's threads itself."""
    if isinstance(grad, list):
        for a, z, g in zip([0, *ends[:-1]], ends, grad, strict=True):
            adamw_parallel_(master[a:z], g, exp_avg[a:z], exp_avg_sq[a:z], None if compute is None else compute[a:z],
                            step, lr, cfg, grad_scale, threads=threads, in_torch_pool=in_torch_pool)
        return
    work, buffers = pieces(ends or [master.numel()]), (master, grad, exp_avg, exp_avg_sq, compute)
    if in_torch_pool:
        return _run(work, buffers, step, lr, cfg, grad_scale, use_c=False)
    n = work[-1][1] if work else 0
    parts = min(threads, max(1, n // SPLIT))
    if parts <= 1:
        return _run(work, buffers, step, lr, cfg, grad_scale)
    edges = sorted({0, n, *(_snap(work, k * n // parts) for k in range(1, parts))})
    run_ranges(lambda a, z: _run(_clip(work, a, z), buffers, step, lr, cfg, grad_scale), edges, threads)


def _snap(work: list[Piece], at: int) -> int:
    start, end, tail = next(p for p in work if p[0] <= at < p[1])
    return end if tail else start + (at - start) // TAIL * TAIL


def _clip(work: list[Piece], a: int, z: int) -> list[Piece]:
    return [(max(s, a), min(e, z), tail) for s, e, tail in work if s < z and e > a]


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
           compute: torch.Tensor | None, step: int, lr: float, cfg: OptimConfig, grad_scale: float = 1.0,
           ends: list[int] | None = None) -> None:
    """One AdamW step (step counts from 1) on flat 1-D fp32 buffers holding tensors that end at
    `ends` (default: one tensor); writes `compute` = master cast (None: the master is the compute copy).

    `grad` may be in the compute dtype (upcast on the fly). `grad_scale` multiplies the gradient
    first (the clipping coefficient), as `clip_grad_norm_` does before `step()`."""
    _run(pieces(ends or [master.numel()]), (master, grad, exp_avg, exp_avg_sq, compute), step, lr, cfg, grad_scale)


def _run(work: list[Piece], buffers: tuple, *hyper, use_c: bool = True) -> None:
    """Each piece of `work` on its kernel: tails, and everything without the C kernel, on torch's."""
    c_kernel = _c_kernel(*buffers) if use_c else None
    for start, end, tail in work:
        kernel = _torch_fused_ if tail or c_kernel is None else c_kernel
        kernel(*(None if t is None else t[start:end] for t in buffers), *hyper)


def _c_kernel(master, grad, exp_avg, exp_avg_sq, compute):
    """The C kernel where it is built, handles these dtypes and agrees with torch here; else None."""
    dtypes = {grad.dtype} if compute is None else {grad.dtype, compute.dtype}
    if kernels.load() is None or not dtypes <= {torch.float32, torch.bfloat16}:
        return None
    return _c_adamw_ if _c_agrees_with_torch() else None


def _c_adamw_(master, grad, exp_avg, exp_avg_sq, compute, step, lr, cfg, grad_scale) -> None:
    beta1, beta2 = cfg.betas
    use_decay, use_scale = int(cfg.weight_decay != 0), int(grad_scale != 1.0)
    bias2_sqrt, neg_step = math.sqrt(1 - beta2 ** step), -(lr / (1 - beta1 ** step))
    p, g, m, v, c = (0 if t is None else t.data_ptr() for t in (master, grad, exp_avg, exp_avg_sq, compute))
    c_bf16 = int(compute is not None and compute.dtype == torch.bfloat16)
    kernels.load().adamw(p, g, int(grad.dtype == torch.bfloat16), m, v, c, c_bf16,
                         master.numel(), 1 - lr * cfg.weight_decay, use_decay, grad_scale, use_scale, 1 - beta1, beta2,
                         1 - beta2, bias2_sqrt, cfg.eps, neg_step)


@cache
def _c_agrees_with_torch() -> bool:
    """Three steps of both kernels on random buffers (weight decay, clipping, fp32 and bf16
    gradients): bitwise equal, or a warning and torch's kernel from then on."""
    generator = torch.Generator().manual_seed(0)
    n = 8 * TAIL
    cfg = OptimConfig(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    start = [torch.randn(n, generator=generator), torch.randn(n, generator=generator) * 1e-3,
             torch.rand(n, generator=generator) * 1e-5]
    ours, theirs = [t.clone() for t in start], [t.clone() for t in start]
    for step in range(1, 4):
        grad = torch.randn(n, generator=generator) * 10.0 ** -step
        grad = grad.bfloat16() if step == 2 else grad
        for kernel, (p, m, v) in ((_c_adamw_, ours), (_torch_fused_, theirs)):
            kernel(p, grad, m, v, torch.empty(n), step, 1e-3, cfg, 0.5 if step == 3 else 1.0)
    if all(torch.equal(a, b) for a, b in zip(ours, theirs)):
        return True
    warnings.warn(f"slidefusion: the C AdamW kernel rounds differently from torch's fused AdamW on this CPU "
                  f"(torch {torch.backends.cpu.get_cpu_capability()}); using torch's kernel", stacklevel=2)
    return False


def _torch_fused_(master, grad, exp_avg, exp_avg_sq, compute, step, lr, cfg, grad_scale, chunk=CHUNK) -> None:
    """torch's fused kernel per chunk (of a TAIL multiple), then the cast."""
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
        if compute is not None:
            compute[start:end].copy_(master[start:end])


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
