"""Sampling a folder with its own scheduler (`slidefusion.pretrained.sampling`) equals the family's own
diffusers pipeline, for all six families: the same seed gives the same initial noise, prompt states,
timesteps, guidance, latents and decoded frames."""

import dataclasses

import pytest
import torch

from slidefusion.pretrained import PretrainedParts, Request, decode, encode_prompts, sample_latents
from slidefusion.testing.pipelines import FAMILIES, PIXELS

PROMPT = "a red circle moving left"


def _pipeline_output(parts, folder, family, output_type, steps, guidance, seed):
    import diffusers

    pipe = getattr(diffusers, parts.folder.pipeline_class).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    frames, height, width = PIXELS[family]
    kwargs = dict(num_inference_steps=steps, guidance_scale=guidance, height=height, width=width,
                  output_type=output_type, generator=torch.Generator().manual_seed(seed))
    kwargs.update(dict(video_length=frames, clean_caption=False) if family == "latte" else dict(num_frames=frames))
    out = pipe(PROMPT, **kwargs).frames
    if output_type == "pt":  # (B, F, 3, H, W) in [0, 1]
        return out.transpose(1, 2) * 2 - 1
    if family == "cogvideox":  # its latents are frames first
        return out.transpose(1, 2)
    if family == "ltx":  # its latents are packed tokens
        from slidefusion.families.ltx import unpack_tokens

        return unpack_tokens(out, (2, height // 4, width // 4), (1, 1, 1))
    return out


@pytest.mark.parametrize("loop", ["family pipeline", "generic loop"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_equals_the_family_pipeline(tiny_pipeline_dir, family, loop, monkeypatch):
    """Both loops: the family's own pipeline (what sampling runs where it can) and the generic loop
    (what runs where the pipeline cannot take the call, e.g. under CFG-parallel)."""
    folder = tiny_pipeline_dir(family)
    parts = PretrainedParts.load(folder)
    frames, height, width = PIXELS[family]
    request = Request(PROMPT, frames=frames, height=height, width=width, steps=2, guidance=4.0, seed=3)
    calls, pipeline_call = [], type(parts.pipeline()).__call__
    monkeypatch.setattr(type(parts.pipeline()), "__call__", lambda *a, **k: calls.append(1) or pipeline_call(*a, **k))
    if loop == "generic loop":
        parts.adapter = dataclasses.replace(parts.adapter, sample=None)
    latents = sample_latents(parts, request)
    assert len(calls) == (loop == "family pipeline")
    reference = _pipeline_output(parts, folder, family, "latent", 2, 4.0, 3)
    assert latents.shape == reference.shape and latents.abs().max() > 0.5
    assert (latents - reference).abs().max() <= 1e-5 * reference.abs().max()
    video = decode(parts, latents)
    expected = _pipeline_output(parts, folder, family, "pt", 2, 4.0, 3)
    assert video.shape == expected.shape == (1, 3, frames, height, width)
    assert (video - expected).abs().max() <= 1e-4


def test_a_seed_is_deterministic_and_another_differs(tiny_pipeline_dir):
    parts = PretrainedParts.load(tiny_pipeline_dir("wan"))
    request = Request(PROMPT, steps=2, guidance=1.0, seed=5)
    first, again = sample_latents(parts, request), sample_latents(parts, request)
    other = sample_latents(parts, Request(PROMPT, steps=2, guidance=1.0, seed=6))
    assert torch.equal(first, again) and not torch.allclose(first, other)


def test_prompt_states_are_the_pipeline_s(tiny_pipeline_dir):
    """Wan zero-pads past the prompt to 512 tokens; HunyuanVideo adds CLIP's pooled output."""
    wan = encode_prompts(PretrainedParts.load(tiny_pipeline_dir("wan"), transformers=False), [PROMPT, "a cat"])
    assert wan.states.shape[:2] == (2, 512) and wan.mask is None
    assert wan.states[1, 3:].abs().max() == 0 and wan.states[1, :3].abs().min() > 0  # "a cat </s>"
    hunyuan = encode_prompts(PretrainedParts.load(tiny_pipeline_dir("hunyuanvideo"), transformers=False), [PROMPT])
    assert hunyuan.pooled is not None and hunyuan.pooled.shape == (1, 8) and hunyuan.mask.dtype == torch.bool
