"""The bundled model: it loads, it fits the size budget, and it draws what the prompt asks for."""

import numpy as np
import torch

from slidefusion.cli import main
from slidefusion.data.shapes import BACKGROUNDS
from slidefusion.eval import detect, score
from slidefusion.pipeline import DEFAULT_PROMPT, VideoPipeline, bundled_checkpoint


def test_bundled_model_is_small_enough_to_ship():
    size = sum(f.stat().st_size for f in bundled_checkpoint().iterdir())
    assert 0 < size <= 25 * 2**20


def test_demo_writes_mp4_and_gif(tmp_path):
    out = tmp_path / "demo.mp4"
    assert main(["demo", "--steps", "3", "--out", str(out), "--quiet"]) == 0
    assert out.stat().st_size > 0 and out.with_suffix(".gif").stat().st_size > 0


def test_bundled_model_draws_the_default_prompt():
    # The default prompt is what `make demo` shows: a red object moving right on black.
    pipe = VideoPipeline.from_checkpoint(None)
    video = pipe(DEFAULT_PROMPT, seed=0, progress=False)
    track = detect(video, "red")
    assert track.present_fraction >= 0.75, track.present
    centres = track.centroid[track.present]
    assert centres[-1][1] - centres[0][1] > 2.0, centres  # pixels to the right
    background = (video.flatten(1).median(dim=1).values + 1) * 127.5  # most pixels are background
    assert np.abs(background.numpy() - BACKGROUNDS["black"]).max() < 40, background


def test_bundled_model_follows_colour_and_background():
    pipe = VideoPipeline.from_checkpoint(None)
    for colour, background in [("blue", "gray"), ("yellow", "navy"), ("green", "black")]:
        video = pipe(f"a {colour} circle moving left quickly on a {background} background", seed=1, progress=False)
        verdict = score(video, f"a {colour} circle moving left quickly on a {background} background")
        assert verdict["color_ok"] and verdict["background_ok"], verdict["objects"]
        pixels = ((video.permute(1, 2, 3, 0) + 1) * 127.5).reshape(-1, 3)  # (N, 3)
        median = pixels.median(dim=0).values
        assert (median - torch.tensor(BACKGROUNDS[background], dtype=torch.float32)).abs().max() < 40, (background, median)
