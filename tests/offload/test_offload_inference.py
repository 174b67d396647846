"""Forward passes outside training on an engine's model (`offload.engine.inference.streamed_inference`):
the blocks stream from the host weights (no second copy of the model), the outputs equal the
resident model's, before and after an update, and the model is left bound to its host buffers."""

import copy

import torch

from slidefusion.families import adapter_for
from slidefusion.offload import OffloadEngine, OffloadPolicy, engine_blocks
from slidefusion.offload.engine.engine import _record
from slidefusion.offload.engine.inference import streamed_inference
from slidefusion.optim import OptimConfig
from slidefusion.testing.tiny import tiny_latents, tiny_model, tiny_text


def _predict(model, step: int = 0):
    x = tiny_latents(model, 2, (2, 4, 6), seed=step)
    return adapter_for(model).raw_output(model, x, torch.tensor([200.0, 800.0]), tiny_text(model, 2, seed=step)).float()


def test_streamed_inference_equals_the_resident_model_and_copies_nothing():
    model = tiny_model("wan").train()
    resident = copy.deepcopy(model)
    optim = OptimConfig(lr=1e-3, max_grad_norm=None, warmup_steps=0, ema_decay=None)
    engine = OffloadEngine(model, engine_blocks(model), OffloadPolicy(device="cpu", compute_dtype=torch.float32,
                                                                      zero_copy=False, optim=optim))
    reference = torch.optim.AdamW(resident.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    streamed = sum(engine.state.blocks[b].numel for b in engine.weights.streamed) * 4
    host = {p.data_ptr() for p in model.parameters()}
    assert streamed > 0
    for _ in range(2):  # before and after an update
        _record(engine, 0.0)
        before = engine.stats.h2d_bytes
        with streamed_inference(engine):
            got = [_predict(model, k) for k in range(2)]
        _record(engine, 0.0)
        assert engine.stats.h2d_bytes - before >= 2 * streamed  # every block streamed, per forward
        assert {p.data_ptr() for p in model.parameters()} == host  # bound to the host buffers again
        assert not any(t.requires_grad for t in got)
        with torch.no_grad():
            expected = [_predict(resident, k) for k in range(2)]
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        engine.train_step(lambda m: _predict(m).pow(2).mean())
        reference.zero_grad()
        _predict(resident).pow(2).mean().backward()
        reference.step()
    engine.close()
