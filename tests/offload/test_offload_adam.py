"""The CPU AdamW kernels against torch.optim.AdamW and clip_grad_norm_."""

import os
import shutil

import pytest
import torch

from slidefusion.offload import kernels
from slidefusion.offload.adam import (
    EXACT_CHUNK,
    adamw_,
    adamw_parallel_,
    adamw_reference_,
    clip_coefficient,
    parameter_norms,
)
from slidefusion.optim import OptimConfig


def _torch_run(p0, grads, cfg, scale=1.0):
    param = torch.nn.Parameter(p0.clone())
    optimizer = torch.optim.AdamW([param], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    for g in grads:
        param.grad = g.float() * scale if scale != 1.0 else g.float().clone()
        optimizer.step()
    state = optimizer.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


def _ours(kernel, p0, grads, cfg, compute_dtype, scale=1.0, **options):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    compute = torch.empty(p0.numel(), dtype=compute_dtype)
    for step, g in enumerate(grads, start=1):
        kernel(p, g, m, v, compute, step, cfg.lr, cfg, grad_scale=scale, **options)
    return p, m, v, compute


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel, options", [(adamw_, {"exact": True}), (adamw_reference_, {})])
def test_exact_kernels_are_bitwise_torch_adamw(grad_dtype, kernel, options):
    torch.manual_seed(0)
    n = 70_001  # not a multiple of any chunk or vector width
    cfg = OptimConfig(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1)
    p0 = torch.randn(n)
    grads = [(torch.randn(n) * torch.rand(n) ** 4).to(grad_dtype) for _ in range(6)]
    expected = _torch_run(p0, grads, cfg, scale=0.3)
    p, m, v, compute = _ours(kernel, p0, grads, cfg, torch.bfloat16, scale=0.3, **options)
    assert torch.equal(p, expected[0]) and torch.equal(m, expected[1]) and torch.equal(v, expected[2])
    assert torch.equal(compute, p.to(torch.bfloat16))  # the same pass wrote the compute copy


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_kernel_is_within_an_ulp_per_step(compute_dtype):
    torch.manual_seed(1)
    n = 50_003
    cfg = OptimConfig(lr=1e-3, weight_decay=0.01)
    p0 = torch.randn(n)
    grads = [torch.randn(n).to(compute_dtype) for _ in range(5)]
    expected = _torch_run(p0, grads, cfg)
    p, _m, v, compute = _ours(adamw_, p0, grads, cfg, compute_dtype, exact=False)
    torch.testing.assert_close(p, expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, expected[2], rtol=1e-6, atol=0)
    assert torch.equal(compute, p.to(compute_dtype))


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


@pytest.mark.parametrize("exact", [True, False])
def test_threaded_update_is_identical_to_one_call(exact):
    torch.manual_seed(3)
    n = 5 * EXACT_CHUNK + 123
    cfg = OptimConfig(lr=1e-3, weight_decay=0.01)
    p0, g = torch.randn(n), torch.randn(n).bfloat16()
    one = _ours(adamw_, p0, [g, g], cfg, torch.bfloat16, exact=exact)
    split = _ours(adamw_parallel_, p0, [g, g], cfg, torch.bfloat16, exact=exact, threads=3)
    assert all(torch.equal(a, b) for a, b in zip(one, split))
