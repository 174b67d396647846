"""Lean host state: the C kernel against its plain-torch reference, the encodings, and the engine."""

import copy
import itertools
import os
import shutil
from pathlib import Path

import pytest
import torch

from slidefusion.offload import OffloadEngine
from slidefusion.offload.engine.layout import layout_of
from slidefusion.offload.optim import kernels
from slidefusion.offload.optim.formats import QBLOCK, block_starts, trainable_bytes_per_param
from slidefusion.offload.optim.lean import (
    LeanBuffers,
    dequantize,
    encode8,
    lean_adamw_,
    lean_adamw_reference_,
    prepared_kernel,
    quantize,
    round_bf16_stochastic,
    seeds,
)
from slidefusion.optim import OptimConfig
from test_offload_engine import MODELS, _loss, _policy

needs_c = pytest.mark.skipif((shutil.which("gcc") is None and shutil.which("cc") is None)
                             or bool(os.environ.get("SLIDEFUSION_NO_C_KERNELS")), reason="no C compiler: reference only")
SIZES = [3000, 1, 4097, 70, QBLOCK, 513]  # parameters of one group: odd sizes, a block exactly, a single value
CFG = OptimConfig(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)


def _buffers(master: str, moments: str, compute: torch.dtype, p0: torch.Tensor, sizes=None) -> LeanBuffers:
    n, sizes = p0.numel(), sizes or [p0.numel()]
    mdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[moments]
    starts = block_starts(layout_of([(f"p{i}", torch.nn.Parameter(torch.zeros(s))) for i, s in enumerate(sizes)]), n) \
        if moments == "int8" else None
    blocks = 0 if starts is None else starts.numel() - 1
    out = None if master != "fp32" and compute == torch.bfloat16 else torch.zeros(n, dtype=compute)
    return LeanBuffers(p0.to(torch.float32 if master == "fp32" else torch.bfloat16).clone(),
                       torch.zeros(n, dtype=torch.bfloat16) if master == "kahan" else None,
                       torch.zeros(n, dtype=mdtype), torch.zeros(n, dtype=mdtype), torch.zeros(blocks), torch.zeros(blocks),
                       starts, torch.zeros(n), out)


def _state(b: LeanBuffers) -> list:
    return [t for t in (b.master, b.comp, b.exp_avg, b.exp_avg_sq, b.m_scale, b.v_scale, b.out) if t is not None]


COMBOS = [(m, v) for m, v in itertools.product(["fp32", "bf16", "kahan"], ["fp32", "bf16", "int8"]) if (m, v) != ("fp32", "fp32")]


@needs_c
@pytest.mark.parametrize("grad_dtype, compute", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                  (torch.float16, torch.float16)])
@pytest.mark.parametrize("master, moments", COMBOS)
def test_the_c_kernel_is_bitwise_its_reference(master, moments, grad_dtype, compute):
    assert kernels.load() is not None
    torch.manual_seed(0)
    p0 = torch.randn(sum(SIZES))
    fast, slow = _buffers(master, moments, compute, p0, SIZES), _buffers(master, moments, compute, p0, SIZES)
    for step in range(1, 5):
        grad = (torch.randn(p0.numel()) * torch.rand(p0.numel()) ** 4).to(grad_dtype)  # a wide dynamic range
        grad[::97] = 0  # and exact zeros
        fast.grad = slow.grad = grad
        lean_adamw_(fast, step, CFG.lr, CFG, 0.7, seeds(0, step, 3))
        lean_adamw_reference_(slow, step, CFG.lr, CFG, 0.7, seeds(0, step, 3))
    assert all(torch.equal(a, b) for a, b in zip(_state(fast), _state(slow)))


@needs_c
@pytest.mark.parametrize("in_torch_pool", [False, True])
@pytest.mark.parametrize("master, moments", [("bf16", "int8"), ("fp32", "bf16"), ("kahan", "bf16")])
def test_threaded_update_is_identical_to_one_call(master, moments, in_torch_pool):
    """Split over 3 threads of the optimizer's pool, or of OpenMP's (torch's own, in line)."""
    torch.manual_seed(1)
    p0 = torch.randn(sum(SIZES) * 8)
    one, split = (_buffers(master, moments, torch.bfloat16, p0, SIZES * 8) for _ in range(2))
    for step in (1, 2):
        one.grad = split.grad = torch.randn(p0.numel()).bfloat16()
        lean_adamw_(one, step, 1e-3, CFG, 1.0, seeds(0, step, 0), threads=1)
        lean_adamw_(split, step, 1e-3, CFG, 1.0, seeds(0, step, 0), threads=3, in_torch_pool=in_torch_pool)
    assert all(torch.equal(a, b) for a, b in zip(_state(one), _state(split)))


@needs_c
def test_the_kernels_share_torchs_openmp_runtime():
    """Built with OpenMP here, and resolved to the libgomp torch loaded: no second pool of threads."""
    if not Path("/proc/self/maps").is_file():
        pytest.skip("needs Linux /proc")
    assert hasattr(kernels.load(), "lean_update_ranges")
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert len({line.split()[-1] for line in maps if "libgomp" in line}) == 1


@needs_c
@pytest.mark.parametrize("master, moments", [("bf16", "int8"), ("bf16", "bf16")])
def test_prepared_kernel_is_one_update(master, moments):
    """The benchmarks' pre-built call applies exactly the update `lean_adamw_` does."""
    torch.manual_seed(2)
    p0 = torch.randn(sum(SIZES))
    once, prepared = (_buffers(master, moments, torch.bfloat16, p0, SIZES) for _ in range(2))
    once.grad = prepared.grad = torch.randn(p0.numel()).bfloat16()
    lean_adamw_(once, 1, 1e-3, CFG, 1.0, seeds(0, 1, 0))
    prepared_kernel(prepared, 1, 1e-3, CFG, 1.0, seeds(0, 1, 0))()
    assert all(torch.equal(a, b) for a, b in zip(_state(once), _state(prepared)))
    assert not torch.equal(once.master, p0.bfloat16())


def test_8bit_codes_land_in_the_bin_holding_the_value():
    x = torch.cat([torch.logspace(-9, 0, 20_000), -torch.logspace(-9, 0, 20_000), torch.zeros(3)])
    block = torch.zeros(x.numel(), dtype=torch.long)
    codes, amax = quantize(x, block, 1, signed=True)
    back = dequantize(codes, amax[block], signed=True)
    inside = x.abs() >= 16.0 ** -7  # 7 decades of 16x for the signed codes; below them: 0
    assert amax.item() == 1.0 and torch.equal(back.sign(), torch.where(inside, x.sign(), 0.0))
    decade = (-torch.log(x.abs().clamp(min=1e-30)) / torch.log(torch.tensor(16.0))).floor().clamp(0, 6)
    width = 15 / 16 * 16.0 ** -decade / 2.0 ** (6 - decade)  # decade d: 2^(6-d) bins
    assert ((back - x).abs() <= 0.5 * width * 1.001)[inside].all()  # the centre of the bin holding x
    assert ((back - x).abs() / x.abs())[x.abs() > 0.1].max() < 0.1  # where the update is decided: < 10 %
    assert (codes[:20_000].long().diff() >= 0).all()  # monotone
    v = torch.tensor([1e-30, 1e-12, 0.0, 1.0])
    codes_v, amax_v = quantize(v, torch.zeros(4, dtype=torch.long), 1, signed=False)
    assert codes_v.tolist()[:3] == [1, 1, 0]  # a positive second moment never becomes 0
    assert dequantize(codes_v, amax_v.expand(4), signed=False)[3] == pytest.approx(1.0, rel=0.01)


def _encode8_by_scaling(x: torch.Tensor, b: int, keep_positive: bool) -> torch.Tensor:
    """The 8-bit encoding written out the long way (scale by 2^t, truncate): what encode8's bit shift replaces."""
    raw = x.view(torch.int32).long()
    d = ((126 - (raw >> 23)) >> 2).clamp(0, b)
    u = (raw + (d << 25)).to(torch.int32).view(torch.float32)
    y = ((u - 0.0625) * torch.tensor(16 / 15, dtype=torch.float32).item() + 1.0) * \
        ((b - 1 - d + 127) << 23).to(torch.int32).view(torch.float32)
    code = y.to(torch.int32).long().clamp(max=(1 << b) - 1)
    return torch.where((d >= b) | (x == 0), ((x > 0) & keep_positive).long(), code)


@pytest.mark.parametrize("magnitude_bits, keep_positive", [(7, False), (8, True)])
def test_8bit_encoding_reads_the_bin_off_the_bits(magnitude_bits, keep_positive):
    """Every float in [2^-33, 1] with its low 7 mantissa bits 0, 1 or 127 (bin edges and their
    neighbours included), plus 0, tiny values and 1: the shift equals scaling and truncating
    (the C kernel's encode8 was also compared on every float in [0, 1] when written)."""
    patterns = torch.arange((127 - 33) << 16, (127 << 16) + 1, dtype=torch.int64) << 7
    patterns = torch.cat([patterns, patterns + 1, patterns + 127, torch.tensor([0, 1, 0x00800000, 0x3F800000])])
    x = patterns.to(torch.int32).view(torch.float32)
    assert torch.equal(encode8(x, magnitude_bits, keep_positive), _encode8_by_scaling(x, magnitude_bits, keep_positive))


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    x = torch.full((200_000,), 1.0 + 2 ** -10)  # a quarter of the way from 1 to the next bf16 value
    rounded = round_bf16_stochastic(x, seeds(0, 1, 0)[0]).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert rounded.mean().item() == pytest.approx(x[0].item(), abs=2e-5)
    assert not torch.equal(rounded, round_bf16_stochastic(x, seeds(0, 2, 0)[0]).float())  # a new stream each step


@pytest.mark.parametrize("master", ["bf16", "kahan"])
def test_bf16_master_keeps_updates_below_half_an_ulp(master):
    """lr 1e-4 steps on weights near 1 (bf16 spacing 2^-7): nearest rounding would never move them."""
    n, steps, lr = 4096, 300, 1e-4
    b = _buffers(master, "fp32", torch.bfloat16, torch.ones(n))
    b.grad = torch.full((n,), -1.0)
    cfg = OptimConfig(lr=lr, weight_decay=0.0)
    for step in range(1, steps + 1):
        lean_adamw_reference_(b, step, lr, cfg, 1.0, seeds(0, step, 0))
    value = b.master.float() + (b.comp.float() if b.comp is not None else 0)
    assert value.mean().item() == pytest.approx(1 + steps * lr, rel=2e-3)


@pytest.mark.parametrize("master, moments", [("fp32", "bf16"), ("fp32", "int8"), ("kahan", "fp32"), ("kahan", "int8"),
                                             ("bf16", "fp32")])
def test_the_reference_tracks_torch_adamw(master, moments):
    torch.manual_seed(2)
    n = 20_000
    b = _buffers(master, moments, torch.float32, torch.randn(n))
    p0 = b.master.float().clone()  # from the same (rounded) start
    param = torch.nn.Parameter(p0.clone())
    torch_opt = torch.optim.AdamW([param], lr=1e-3, betas=CFG.betas, weight_decay=0.1)
    for step in range(1, 21):
        grad = torch.randn(n) * (1 + torch.arange(n) % 7)
        param.grad = grad.clone()
        torch_opt.step()
        b.grad = grad
        lean_adamw_reference_(b, step, 1e-3, CFG, 1.0, seeds(0, step, 0))
    ours = b.out if b.out is not None else b.master.float()
    if master == "bf16":  # stochastic rounding: each weight is off by ~ulp * sqrt(steps), but not on average
        direction = (param.detach() - p0).sign()  # a stalled weight would lag behind in its own direction
        drift = ((ours - param.detach()) * direction).mean().abs()
        assert drift < 0.05 * (param.detach() - p0).abs().mean(), drift
        return
    moved, off = (param.detach() - p0).norm(), (ours - param.detach()).norm()
    assert off < 0.05 * moved, (off / moved).item()


@pytest.mark.parametrize("master, moments, rounding", [("bf16", "int8", "stochastic"), ("fp32", "bf16", "stochastic"),
                                                       ("bf16", "bf16", "kahan")])
def test_lean_engines_train_like_fp32_and_resume_exactly(master, moments, rounding):
    """The in-suite quality check (the 300-step one is experiments/offload_lean.py)."""
    run = lambda engine, first, count: [engine.train_step(lambda m, s=s: _loss("dit3d", m, s)) for s in range(first, first + count)]  # noqa: E731
    model = MODELS["dit3d"]()
    fp32_model = copy.deepcopy(model)
    fp32 = OffloadEngine(fp32_model, fp32_model.blocks, _policy(torch.bfloat16))
    lean = OffloadEngine(model, model.blocks, _policy(torch.bfloat16, master=master, moments=moments, rounding=rounding))
    expected, got = run(fp32, 0, 12), run(lean, 0, 6)
    state = lean.state_dict()
    got += run(lean, 6, 6)
    assert abs(got[-1] - expected[-1]) <= 0.01 * expected[-1]
    assert lean.stats.host_bytes_per_param == pytest.approx(
        trainable_bytes_per_param(torch.bfloat16, master, moments, rounding), abs=0.02)
    again = MODELS["dit3d"]()
    resumed = OffloadEngine(again, again.blocks, _policy(torch.bfloat16, master=master, moments=moments, rounding=rounding))
    resumed.load_state_dict(state)
    assert run(resumed, 6, 6) == got[6:]  # the rounding streams are a function of (seed, step, group)
    for engine in (fp32, lean, resumed):
        engine.close()
