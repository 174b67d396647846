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
    """On every rank: each case (name, model, shape, ParallelConfig) sampled in parallel, in one group.
    Model "X:pipeline" runs diffusers' WanPipeline around X; "vae" / "vae2d" decode latents of
    `shape` split over the group; config None calls the model after earlier cases hooked and detached it."""
    from slidefusion.parallel import parallelize

    torch.set_num_threads(1)
    models, out = {}, {}
    for name, model_name, shape, config in cases:
        try:
            out[name] = _run_case(models, model_name, shape, config, parallelize)
        except Exception as error:  # a UserError is an expected answer for some cases
            out[name] = f"{type(error).__name__}: {error}"
    return out


def _run_case(models, model_name, shape, config, parallelize):
    if model_name.startswith("vae"):
        from slidefusion.parallel.comm import Comm

        return decode_case(model_name, shape, Comm())
    base, _, sampler = model_name.partition(":")
    model = models.setdefault(base, build(base))
    if config is None:  # the model itself, after earlier cases hooked it: must be unchanged
        return sample_any(model, shape)
    batch = 1 if config.cfg_parallel else 2  # what each group's model call sees (CFG doubles)
    handle = parallelize(model, config, latent_shape=None if shape is None else (batch, *shape[1:]))
    try:
        return SAMPLERS[sampler](model, shape)
    finally:
        handle.detach()


def tiny_vae(name: str, channels: int):
    """"vae": AutoencoderKLWan (Wan's causal 3D VAE); "vae2d": a 2-D AutoencoderKL as Latte's."""
    from slidefusion.testing.tiny import tiny_wan_vae

    if name == "vae":
        return tiny_wan_vae(channels)
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=channels, block_out_channels=(8, 16),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         norm_num_groups=4).eval()


def decode_case(name, shape, comm=None):
    """Latents of `shape` decoded by the tiny VAE `name`, split over `comm` (None: one decode)."""
    from slidefusion.parallel.decode import decode_video

    z = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    return decode_video(tiny_vae(name, shape[1]), z, comm)


def reference(model_name, shape):
    """The single-process answer of a case."""
    if model_name.startswith("vae"):
        return decode_case(model_name, shape)
    base, _, sampler = model_name.partition(":")
    return SAMPLERS[sampler](build(base), shape)


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


# ---------------------------------------------------------------- tiny diffusers models
# 5 heads (2, 3 and 4 ranks split them unevenly); Latte's text width follows its inner width.
DIFFUSERS = {"latte-5h": ("latte", {"num_attention_heads": 5, "cross_attention_dim": 40}),
             "wan-5h": ("wan", {"num_attention_heads": 5}),
             "wan2.2-5h": ("wan2.2-ti2v", {"num_attention_heads": 5})}


def build(name: str):
    """Our preset (see VARIANTS) or a tiny diffusers model (see DIFFUSERS)."""
    if name not in DIFFUSERS:
        return random_model(name)
    from slidefusion.testing.tiny import tiny_model

    family, overrides = DIFFUSERS[name]
    return tiny_model(family, **overrides)


def scheduler_parts(model):
    """`denoise`'s parts for a bare transformer: its adapter and the family's scheduler."""
    from diffusers import DDIMScheduler

    from slidefusion.families import adapter_for
    from slidefusion.pretrained import PretrainedParts
    from slidefusion.testing.tiny import wan_scheduler

    adapter = adapter_for(model)
    if adapter.family == "wan":
        adapter = adapter.with_options(expand_timesteps=model.config.in_channels == 48)  # 2.2 TI2V
    scheduler = wan_scheduler() if adapter.family == "wan" else DDIMScheduler(clip_sample=False)
    return PretrainedParts(None, adapter, [(model, float("-inf"))], None, None, None, scheduler)


def sample_any(model, shape, steps=2):
    """Our sampler for our models; the family's scheduler loop (`denoise`, CFG batch 2) for diffusers'."""
    if not hasattr(model, "embed"):
        from slidefusion.pretrained import denoise
        from slidefusion.testing.tiny import tiny_text

        parts = scheduler_parts(model)
        channels = parts.adapter.latent_channels(model)
        noise = torch.randn(1, channels, *shape[2:], generator=torch.Generator().manual_seed(2))
        cond, uncond = tiny_text(model, 1, seed=1), tiny_text(model, 1, seed=2, lengths=[3])
        return denoise(parts, noise, cond, uncond, steps, 4.0)
    return run_sample(model, shape, steps)


def one_call(model, shape):
    """The model's prediction for a CFG batch of 2 at one timestep (adapter.predict)."""
    from slidefusion.families import adapter_for
    from slidefusion.testing.tiny import tiny_latents, tiny_text

    with torch.no_grad():
        return adapter_for(model).predict(model, tiny_latents(model, 2, shape[2:]), torch.tensor([700, 300]),
                                          tiny_text(model, 2, lengths=[8, 3]))


def wan_pipeline_latents(model, shape=None):
    """diffusers' own WanPipeline loop (cond and uncond as separate calls) around `model`."""
    from diffusers import WanPipeline

    from slidefusion.testing.tiny import tiny_tokenizer, tiny_umt5, tiny_wan_vae, wan_scheduler

    tokenizer = tiny_tokenizer()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=tiny_umt5(len(tokenizer)), vae=tiny_wan_vae(),
                       transformer=model, scheduler=wan_scheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe("a red circle moving left", num_frames=5, height=48, width=80, num_inference_steps=2,
                guidance_scale=4.0, output_type="latent", generator=torch.Generator().manual_seed(0)).frames


SAMPLERS = {"": sample_any, "pipeline": wan_pipeline_latents, "call": one_call}
