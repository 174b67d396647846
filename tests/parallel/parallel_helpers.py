"""Shared helpers for the spawned parallel tests (module-level, so spawned ranks can import them)."""

import os
import time

import torch

from slidefusion.diffusion import sample
from slidefusion.models import build_model, preset

os.environ.setdefault("OMP_NUM_THREADS", "1")


# Models with 5 heads, which 2, 3 and 4 ranks all split unevenly (Ulysses needs ranks <= heads).
VARIANTS = {"dit3d-5h": ("dit3d-tiny", {"hidden": 40, "heads": 5}),
            "stdit-5h": ("stdit-tiny", {"hidden": 40, "heads": 5})}


def random_model(name: str = "stdit-tiny", seed: int = 0):
    """A model with every weight nonzero (as VideoPipeline.from_preset), so every layer matters."""
    torch.manual_seed(seed)
    base, overrides = VARIANTS.get(name, (name, {}))
    model = build_model(preset(base, **overrides))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model.eval()


def conditions():
    """Random cond / uncond text states of different lengths (the sampler pads them)."""
    g = torch.Generator().manual_seed(1)
    cond = (torch.randn(1, 5, 384, generator=g), torch.ones(1, 5, dtype=torch.bool))
    uncond = (torch.randn(1, 3, 384, generator=g), torch.ones(1, 3, dtype=torch.bool))
    return cond, uncond


def run_sample(model, shape, steps=2):
    cond, uncond = conditions()
    return sample(model, shape, cond, uncond, steps=steps, guidance=4.0, progress=False)


def run_cases(rank, world, cases):
    """On every rank: each case (name, preset, shape, ParallelConfig) sampled in parallel, in one group."""
    from slidefusion.parallel import parallelize

    torch.set_num_threads(1)
    models, out = {}, {}
    for name, model_name, shape, config in cases:
        model = models.setdefault(model_name, random_model(model_name))
        if config is None:  # the model itself, called after earlier cases hooked it: must be unchanged
            out[name] = run_sample(model, shape)
            continue
        try:
            batch = 1 if config.cfg_parallel else 2  # what each group's model call sees (CFG doubles)
            out[name] = run_sample(parallelize(model, config, latent_shape=(batch, *shape[1:])), shape)
        except Exception as error:  # a UserError is an expected answer for some cases
            out[name] = f"{type(error).__name__}: {error}"
    return out


def die_mid_run(rank, world, mode):
    """Rank 1 dies (or hangs) after the first step; rank 0 must end with an error on its own."""
    from slidefusion.parallel import ParallelConfig, parallelize

    model = parallelize(random_model(), ParallelConfig("scalefusion", 2, timeout_s=4))
    cond, uncond = conditions()
    v = model(torch.randn(2, 3, 5, 6, 10), torch.rand(2), torch.randn(2, 5, 384), None)
    if rank == 1:
        if mode == "exit":
            os._exit(3)
        time.sleep(20)  # alive but silent long past rank 0's 4 s timeout: only the timeout ends its wait
        os._exit(4)
    start = time.monotonic()
    try:
        model(torch.randn(2, 3, 5, 6, 10), torch.rand(2), torch.randn(2, 5, 384), None)
    except Exception as error:
        raise RuntimeError(f"after {time.monotonic() - start:.1f} s: {error}") from error
    return v
