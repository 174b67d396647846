"""The CPU AdamW kernels against torch.optim.AdamW(fused=True) and clip_grad_norm_."""

import os
import shutil

import pytest
import torch

from slidefusion.offload.optim import adam
from slidefusion.offload.optim import kernels
from slidefusion.offload.optim.adam import TAIL, adamw_, adamw_parallel_, clip_coefficient, parameter_norms, pieces
from slidefusion.optim import OptimConfig

SIZES = [70_001, 1, 15, 64, 17, 3 * TAIL, 129, 4096 + 5]  # tails of every length, whole tensors, a single element


def _torch_run(p0, grads, cfg, sizes, scale=1.0):
    """torch.optim.AdamW(fused=True) on tensors of `sizes` laid end to end in p0 (clipped by `scale`)."""
    params = [torch.nn.Parameter(t.clone()) for t in p0.split(sizes)]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                  fused=True)
    for g in grads:
        for param, part in zip(params, g.float().split(sizes)):
            param.grad = part * scale if scale != 1.0 else part.clone()
        optimizer.step()
    return [torch.cat([t.detach().flatten() if k == "p" else optimizer.state[t][k].flatten() for t in params])
            for k in ("p", "exp_avg", "exp_avg_sq")]


def _ours(kernel, p0, grads, cfg, compute_dtype, scale=1.0, **options):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    compute = torch.empty(p0.numel(), dtype=compute_dtype)
    for step, g in enumerate(grads, start=1):
        kernel(p, g, m, v, compute, step, cfg.lr, cfg, grad_scale=scale, **options)
    return p, m, v, compute


def _ends(sizes):
    return torch.tensor(sizes).cumsum(0).tolist()


@pytest.mark.parametrize("grad_dtype, compute_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                       (torch.float32, torch.float16)])
@pytest.mark.parametrize("c_kernel", [True, False], ids=["c", "torch"])
@pytest.mark.parametrize("betas", [(0.8, 0.99), (0.3, 0.9)], ids=["lerp-small", "lerp-large"])
def test_kernel_is_bitwise_torch_fused_adamw(grad_dtype, compute_dtype, c_kernel, betas, monkeypatch):
    if not c_kernel:
        monkeypatch.setattr(adam, "_c_kernel", lambda *buffers: None)
    torch.manual_seed(0)
    n = sum(SIZES)
    cfg = OptimConfig(lr=1e-2, betas=betas, eps=1e-8, weight_decay=0.1)
    p0 = torch.randn(n)
    grads = [(torch.randn(n) * torch.rand(n) ** 4).to(grad_dtype) for _ in range(6)]
    expected = _torch_run(p0, grads, cfg, SIZES, scale=0.3)
    p, m, v, compute = _ours(adamw_, p0, grads, cfg, compute_dtype, scale=0.3, ends=_ends(SIZES))
    assert torch.equal(p, expected[0]) and torch.equal(m, expected[1]) and torch.equal(v, expected[2])
    assert torch.equal(compute, p.to(compute_dtype))  # the same pass wrote the compute copy


def test_torch_default_adamw_differs_only_by_its_square_root():
    """Why the target is the fused optimizer: the default one's MKL square root is sometimes 1 ulp
    off (low only, on ~0.6 % of inputs, on the earlier sessions' CPU; either way on ~20 % on an AMD Zen 5)."""
    torch.manual_seed(4)
    v = torch.rand(100_000)
    correctly_rounded = v.double().sqrt().float()
    off = torch.sqrt(v) != correctly_rounded
    if not off.any():
        pytest.skip("this torch build's sqrt is correctly rounded")
    ulps = (torch.sqrt(v).view(torch.int32) - correctly_rounded.view(torch.int32)).abs()
    assert ulps.max() == 1


def test_tails_are_left_to_torch():
    assert pieces([64, 64 + 200, 264 + 15]) == [(0, 256, False), (256, 264, True), (264, 279, True)]
    assert pieces([5]) == [(0, 5, True)]
    assert pieces([]) == []


def test_the_c_kernel_agrees_with_torch_here():
    if kernels.load() is None:
        pytest.skip("no C kernels here")
    assert adam._c_agrees_with_torch()


@pytest.mark.skipif((shutil.which("gcc") is None and shutil.which("cc") is None) or bool(os.environ.get("SLIDEFUSION_NO_C_KERNELS")),
                    reason="no C compiler (or switched off): torch fallbacks")
def test_the_c_kernels_build_here():
    assert kernels.load() is not None


def test_clip_coefficient_is_clip_grad_norm():
    torch.manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s)) for s in (7, 300, 1)]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in params]
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    scale = clip_coefficient(parameter_norms(grads), 0.5)
    assert scale < 1
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g * torch.tensor(scale))
    assert clip_coefficient(parameter_norms(grads), 1e9) == 1.0


def test_threaded_update_is_identical_to_one_call():
    torch.manual_seed(3)
    sizes = [5 * (1 << 15) + 123, 7, 3 * (1 << 15) + 64, 33]
    n, ends = sum(sizes), _ends(sizes)
    cfg = OptimConfig(lr=1e-3, weight_decay=0.01)
    p0, g = torch.randn(n), torch.randn(n)
    one = _ours(adamw_, p0, [g, g], cfg, torch.float32, ends=ends)
    for threads in (2, 3, 5):
        for in_torch_pool in (False, True):  # our pool's threads, or torch's kernel on its own
            split = _ours(adamw_parallel_, p0, [g, g], cfg, torch.float32, ends=ends, threads=threads,
                          in_torch_pool=in_torch_pool)
            assert all(torch.equal(a, b) for a, b in zip(one, split))


@pytest.mark.parametrize("c_kernel", [True, False], ids=["c", "torch"])
def test_without_a_copy_the_update_is_the_same(c_kernel, monkeypatch):
    """compute=None (the fp32 master is the fp32 compute copy): the same update, nothing else written."""
    if not c_kernel:
        monkeypatch.setattr(adam, "_c_kernel", lambda *buffers: None)
    torch.manual_seed(5)
    n = sum(SIZES)
    cfg = OptimConfig(lr=1e-3, weight_decay=0.01)
    p0, grads = torch.randn(n), [torch.randn(n) for _ in range(3)]
    copied = _ours(adamw_, p0, grads, cfg, torch.float32, ends=_ends(SIZES))
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, start=1):
        adamw_parallel_(p, g, m, v, None, step, cfg.lr, cfg, ends=_ends(SIZES), threads=2)
    assert torch.equal(p, copied[0]) and torch.equal(m, copied[1]) and torch.equal(v, copied[2])
