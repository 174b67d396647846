"""`VideoPipeline` and `FolderPipeline` speak diffusers' call names and keep today's API: the same
latents as the family's diffusers pipeline for the same generator, list prompts with a generator each,
output types, `.to`, and save_pretrained / from_pretrained round trips."""

import numpy as np
import pytest
import torch

from slidefusion.core.errors import UserError
from slidefusion.pipeline import FolderPipeline, VideoPipeline, VideoPipelineOutput

CALL = dict(num_frames=5, height=48, width=80, num_inference_steps=2, guidance_scale=4.0)


def test_a_folder_pipeline_is_called_as_the_diffusers_pipeline(tiny_wan_dir):
    import diffusers

    pipe = VideoPipeline.from_pretrained(tiny_wan_dir).to("cpu")
    assert isinstance(pipe, FolderPipeline) and pipe.fps == 16
    ours = pipe("a red circle", output_type="latent", generator=torch.Generator().manual_seed(3), **CALL).frames
    reference = diffusers.WanPipeline.from_pretrained(tiny_wan_dir)
    reference.set_progress_bar_config(disable=True)
    theirs = reference("a red circle", output_type="latent", generator=torch.Generator().manual_seed(3), **CALL).frames
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    assert torch.equal(ours, pipe.latents("a red circle", frames=5, height=48, width=80, steps=2, guidance=4.0, seed=3,
                                          progress=False))
    both = pipe(["a red circle", "a blue square"], output_type="np", **CALL,
                generator=[torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)])
    assert isinstance(both, VideoPipelineOutput) and both.frames.shape == (2, 5, 48, 80, 3)
    assert both.frames.min() >= 0 and both.frames.max() <= 1
    alone = pipe("a red circle", output_type="np", generator=torch.Generator().manual_seed(3), **CALL).frames
    np.testing.assert_allclose(both.frames[:1], alone, atol=1e-4)  # prompt 0 with its own generator
    (video,) = pipe("a red circle", output_type="pt", seed=3, return_dict=False, **CALL)
    assert video.shape == (1, 5, 3, 48, 80)


def test_folder_pipeline_save_pretrained_round_trips(tiny_wan_dir, tmp_path):
    pipe = FolderPipeline.from_pretrained(tiny_wan_dir)
    out = pipe.save_pretrained(tmp_path / "copy")
    again = VideoPipeline.from_pretrained(out)
    kwargs = dict(frames=5, height=48, width=80, steps=2, seed=1, progress=False)
    assert torch.equal(pipe.latents("a cat", **kwargs), again.latents("a cat", **kwargs))
    with pytest.raises(UserError, match="already exists"):
        pipe.save_pretrained(out)


def test_our_pipeline_takes_diffusers_names_and_keeps_its_own(tmp_path):
    pipe = VideoPipeline.from_preset("dit3d-tiny", seed=3)
    sizes = dict(frames=4, height=8, width=8, steps=3)
    legacy = pipe("a red circle", seed=5, progress=False, **sizes)  # today's API: the video (3, T, H, W)
    assert legacy.shape == (3, 4, 8, 8)
    out = pipe("a red circle", num_frames=4, height=8, width=8, num_inference_steps=3, guidance_scale=4.0,
               generator=torch.Generator().manual_seed(5), output_type="pt")
    torch.testing.assert_close(out.frames[0].transpose(0, 1) * 2 - 1, legacy, atol=1e-6, rtol=0)
    saved = VideoPipeline.from_pretrained(pipe.save_pretrained(tmp_path / "ours"))
    assert torch.equal(saved.latents("a red circle", seed=5, progress=False, **sizes),
                       pipe.latents("a red circle", seed=5, progress=False, **sizes))
    with pytest.raises(UserError, match="output_type='gif' is unknown"):
        pipe("a red circle", output_type="gif", **sizes)
