"""Gradient accumulation: a step of N micro-batches (each loss scaled by its share) equals one step on
the batch of all of them within float32 rounding, resident and offloaded (the engine sums gradients
in host buffers; immediate and clipped updates; staged and in-place gradients), full and LoRA."""

import copy

import pytest
import torch

from slidefusion.families import adapter_for
from slidefusion.offload import OffloadEngine, OffloadPolicy, engine_blocks
from slidefusion.optim import OptimConfig
from slidefusion.testing.tiny import tiny_latents, tiny_model, tiny_text
from slidefusion.training.task import ResidentOptimizer

BATCH, STEPS = 4, 3
# eps of 0.1: Adam's first steps are sign(g) * lr for |g| >> eps, which would turn a last-bit difference
# of a near-zero gradient (summation order) into a whole step; with eps large the update is smooth
OPTIM = dict(lr=1e-2, eps=0.1, weight_decay=0.01, warmup_steps=0, ema_decay=None)


def _model(lora: bool):
    model = tiny_model("wan").train()
    if lora:
        from slidefusion.pretrained import lora as lora_lib
        from slidefusion.pretrained.config import LoraConfig

        lora_lib.add_lora(model, LoraConfig(rank=4), adapter_for(model).lora_targets)
        weights = lora_lib.initial_lora_weights(model, seed=1)
        model.load_state_dict({k: v + 0.05 if ".lora_B." in k else v for k, v in weights.items()}, strict=False)
    return model


def _batch(step: int):
    model = tiny_model("wan")
    x = tiny_latents(model, BATCH, (2, 4, 6), seed=step)
    t = torch.linspace(100, 900, BATCH) + step
    target = x.flip(0) * 0.5
    return x, t, tiny_text(model, BATCH, seed=step), target


def _loss(rows: slice, step: int, weight: float = 1.0):
    x, t, text, target = _batch(step)
    text = type(text)(text.states[rows], None, None)

    def loss(model):
        out = adapter_for(model).raw_output(model, x[rows], t[rows], text).float()
        return ((out - target[rows]) ** 2).mean() * weight
    return loss


def _fns(step: int, micro: int):
    """One step: the whole batch, or `micro` equal micro-batches each scaled by 1 / micro."""
    if micro == 1:
        return _loss(slice(0, BATCH), step)
    size = BATCH // micro
    return [_loss(slice(k * size, (k + 1) * size), step, 1 / micro) for k in range(micro)]


def _train(optimizer, micro: int) -> list[float]:
    return [optimizer.train_step(_fns(step, micro)) for step in range(STEPS)]


def _trained(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["immediate", "clipped"])
def test_resident_accumulation_equals_the_large_batch(lora, clip):
    model = _model(lora)
    large, small = copy.deepcopy(model), copy.deepcopy(model)
    optim = OptimConfig(max_grad_norm=clip, **OPTIM)
    expected = _train(ResidentOptimizer(large, optim), 1)
    got = _train(ResidentOptimizer(small, optim), 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for name, value in _trained(large).items():
        torch.testing.assert_close(_trained(small)[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["immediate", "clipped"])
@pytest.mark.parametrize("zero_copy", [None, False], ids=["in-place", "staged"])
def test_offloaded_accumulation_equals_the_large_batch_and_resident_accumulation(lora, clip, zero_copy):
    model = _model(lora)
    large, resident = copy.deepcopy(model), copy.deepcopy(model)
    optim = OptimConfig(max_grad_norm=clip, **OPTIM)
    engine = OffloadEngine(model, engine_blocks(model), OffloadPolicy(device="cpu", compute_dtype=torch.float32,
                                                                      zero_copy=zero_copy, optim=optim))
    got = _train(engine, 2)
    expected = _train(ResidentOptimizer(large, optim), 1)
    accumulated = _train(ResidentOptimizer(resident, optim), 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(got, accumulated, rtol=1e-5, atol=0)
    state = engine.model_state_dict()
    for name, value in _trained(large).items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(state[name], _trained(resident)[name], rtol=1e-5, atol=1e-6, msg=name)
    assert engine.stats.staging_bytes >= 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine.close()


def test_offloaded_accumulation_survives_random_delays():
    """The host sums under an overlapped worker and copy threads with jitter: the adds, the update
    and the next step's first copy into the sums must not race."""
    import random

    model = _model(False)
    large = copy.deepcopy(model)
    optim = OptimConfig(max_grad_norm=None, **OPTIM)
    engine = OffloadEngine(model, engine_blocks(model), OffloadPolicy(device="cpu", compute_dtype=torch.float32,
                                                                      zero_copy=False, overlap=True, optim=optim))
    rng = random.Random(0)
    jitter = lambda: __import__("time").sleep(rng.random() * 0.002)  # noqa: E731
    engine.worker.jitter = jitter
    for copier in (engine.h2d, engine.d2h):
        copier.set_jitter(jitter)
    got = _train(engine, 4)
    expected = _train(ResidentOptimizer(large, optim), 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    state = engine.model_state_dict()
    for name, value in _trained(large).items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    engine.close()
