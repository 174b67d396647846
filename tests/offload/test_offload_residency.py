"""Partial residency (`resident_blocks`) and page-locking that falls back instead of failing."""

import copy
import warnings

import pytest
import torch

from slidefusion.errors import UserError
from slidefusion.models import build_model, preset
from slidefusion.offload import OffloadEngine
from slidefusion.offload.engine.pinning import HostAllocator
from slidefusion.offload.plan.footprint import engine_plan
from slidefusion.offload.plan.resolve import auto_resident_blocks
from slidefusion.testing.delays import inject_delays
from test_offload_engine import MODELS, _loss, _policy


def _run(kind, resident_blocks, steps=8, delays=0.0, **options):
    model = MODELS[kind]()
    engine = OffloadEngine(model, model.blocks, _policy(resident_blocks=resident_blocks, **options))
    inject_delays(engine, delays, seed=resident_blocks)
    losses = [engine.train_step(lambda m, s=s: _loss(kind, m, s)) for s in range(steps)]
    weights = engine.model_state_dict()
    engine.close()
    return losses, weights, engine.stats


@pytest.mark.parametrize("kind, resident, options", [("dit3d", 1, {}), ("dit3d", 3, {"max_grad_norm": 0.05}),
                                                     ("wan", 2, {"prefetch": 0}), ("stdit", 2, {"checkpoint": False})])
def test_resident_blocks_are_bitwise_full_streaming(kind, resident, options):
    streamed, weights, stats = _run(kind, 0, **options)
    kept, kept_weights, kept_stats = _run(kind, resident, delays=0.002, **options)
    assert kept == streamed
    assert all(torch.equal(kept_weights[k], v) for k, v in weights.items())
    if options.get("checkpoint", True):  # a resident block is uploaded once a step (after its update), not twice
        assert kept_stats.h2d_bytes < stats.h2d_bytes
    assert kept_stats.d2h_bytes == stats.d2h_bytes  # its optimizer still runs on the host


def test_auto_residency_takes_what_the_device_plan_leaves():
    model = build_model(preset("dit3d-tiny", depth=6, text_dim=16))
    block = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    base = engine_plan(model, model.blocks, _policy(), activation_bytes=10_000).device_bytes
    # N resident blocks take N blocks more; all 6 also free the 2 streaming slots (6 - 2 = 4 more)
    for room, expected in ((0.5, 0), (1.5, 1), (2.2, 2), (3.9, 3), (4.1, 6)):
        assert auto_resident_blocks(model, model.blocks, _policy(), 10_000, base + int(room * block)) == expected
    assert auto_resident_blocks(model, model.blocks, _policy(), 0) == 0  # a CPU device: its size is unknown


class FakePinner:
    """Stands in for cudaHostRegister: records every call, fails once `capacity` bytes are locked."""

    def __init__(self, capacity: int):
        self.capacity, self.locked, self.calls = capacity, {}, []

    def register(self, ptr: int, nbytes: int) -> bool:
        self.calls.append(nbytes)
        if sum(self.locked.values()) + nbytes > self.capacity:
            return False
        self.locked[ptr] = nbytes
        return True

    def unregister(self, ptr: int) -> None:
        del self.locked[ptr]


def test_pinning_is_chunked_and_falls_back_with_one_warning():
    pinner = FakePinner(capacity=3 << 20)
    allocator = HostAllocator(pinner, budget=None, chunk=1 << 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = allocator.empty((2 << 20) // 4, torch.float32, dma=True)  # 2 chunks
        master = allocator.empty(1 << 20, torch.float32, dma=False)  # CPU-only: never locked
        second = allocator.empty((2 << 20) // 2, torch.bfloat16, dma=True)  # would pass 3 MB: fails, undone
        third = allocator.empty(1024, torch.bfloat16, dma=True)  # after a failure nothing more is tried
    assert max(pinner.calls) <= 1 << 20 and len(pinner.calls) == 4  # 2 + 2 (the second call of `second` fails)
    assert allocator.pinned_bytes == 2 << 20 and sum(pinner.locked.values()) == 2 << 20
    assert allocator.pageable_dma_bytes == (2 << 20) + 2048
    assert len(caught) == 1 and "page-locking failed" in str(caught[0].message) and "\n" not in str(caught[0].message)
    assert first.data_ptr() % 4096 == 0 and second.numel() == (1 << 20) and master.numel() == third.numel() * 1024
    allocator.close()
    assert pinner.locked == {}


def test_the_pin_budget_keeps_later_buffers_pageable():
    allocator = HostAllocator(FakePinner(capacity=1 << 40), budget=3 << 20, chunk=1 << 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            allocator.empty((2 << 20) // 4, torch.float32, dma=True)
    assert allocator.pinned_bytes == 2 << 20 and allocator.pageable_dma_bytes == 4 << 20
    assert len(caught) == 1 and "offload.pin_budget" in str(caught[0].message)


def test_an_engine_whose_pinning_fails_trains_the_same():
    model = MODELS["dit3d"]()
    reference = copy.deepcopy(model)
    allocator = HostAllocator(FakePinner(capacity=200_000), budget=None, chunk=64 << 10)
    with pytest.warns(RuntimeWarning, match="page-locking failed"):
        engine = OffloadEngine(model, model.blocks, _policy(), allocator=allocator)
    assert 0 < engine.stats.pinned_bytes <= 200_000 and engine.stats.pageable_copy_bytes > 0
    plain = OffloadEngine(reference, reference.blocks, _policy())
    for step in range(4):
        assert engine.train_step(lambda m, s=step: _loss("dit3d", m, s)) == plain.train_step(lambda m, s=step: _loss("dit3d", m, s))
    assert plain.stats.pinned_bytes == 0  # a CPU device locks nothing


@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.05}, {"checkpoint": False}, {"resident_blocks": 2}])
def test_computing_in_place_on_a_cpu_device_is_bitwise_the_copying_engine(options):
    copied, copied_weights, _ = _run("dit3d", options.pop("resident_blocks", 0), zero_copy=False, **options)
    direct, direct_weights, stats = _run("dit3d", 0, delays=0.002, zero_copy=True, **options)
    assert direct == copied and all(torch.equal(direct_weights[k], v) for k, v in copied_weights.items())
    assert stats.h2d_bytes == 0 and stats.device_param_bytes_reserved == 0  # nothing was copied
    assert stats.staging_bytes == 0  # fp32 state: each gradient is read where autograd wrote it
    assert stats.exposed_optimizer_s >= stats.optimizer_s > 0  # in line (not overlapped): the compute ran it


@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.05}, {"master": "bf16", "moments": "int8"},
                                     {"moments": "bf16", "compute_dtype": torch.bfloat16, "max_grad_norm": 0.05}])
def test_updates_in_line_are_bitwise_the_overlapped_ones(options):
    """On a CPU device computing in place the updates run in the backward, on torch's threads (fp32
    state: torch's fused kernel, elsewhere the C one); overlapping them on the worker thread is the
    GPU's schedule. Both give the same bits, in every state format."""
    overlapped, overlapped_weights, _ = _run("dit3d", 0, delays=0.002, zero_copy=True, overlap=True, **options)
    in_line, in_line_weights, stats = _run("dit3d", 0, zero_copy=True, **options)
    assert in_line == overlapped and all(torch.equal(in_line_weights[k], v) for k, v in overlapped_weights.items())
    assert stats.exposed_optimizer_s >= stats.optimizer_s > 0


def test_updates_overlap_by_default_except_on_a_cpu_device_computing_in_place():
    assert _policy(zero_copy=True).overlapped is False and _policy(zero_copy=True).threads == torch.get_num_threads()
    assert _policy(zero_copy=False).overlapped and _policy(zero_copy=False).threads == 1  # a simulated device
    assert _policy(zero_copy=True, overlap=True).overlapped and _policy(zero_copy=True, optimizer_threads=3).threads == 3
    with pytest.raises(UserError, match="overlap='yes' must be True, False or None"):
        _policy(overlap="yes")
