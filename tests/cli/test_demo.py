"""The bundled model: it loads, it fits the size budget, and it draws what the prompt asks for."""

import numpy as np
import torch

from slidefusion.cli import main
from slidefusion.data.shapes import BACKGROUNDS, COLORS
from slidefusion.pipeline import DEFAULT_PROMPT, VideoPipeline, bundled_checkpoint


def test_bundled_model_is_small_enough_to_ship():
    size = sum(f.stat().st_size for f in bundled_checkpoint().iterdir())
    assert 0 < size <= 25 * 2**20


def test_demo_writes_mp4_and_gif(tmp_path):
    out = tmp_path / "demo.mp4"
    assert main(["demo", "--steps", "3", "--out", str(out), "--quiet"]) == 0
    assert out.stat().st_size > 0 and out.with_suffix(".gif").stat().st_size > 0


def _centroids(video: torch.Tensor, rgb) -> np.ndarray:
    """(T, 2) centre (y, x) of the pixels closest to colour `rgb` in each frame of (3, T, H, W)."""
    pixels = (video.permute(1, 2, 3, 0) + 1) * 127.5  # (T, H, W, 3) in [0, 255]
    near = (pixels - torch.tensor(rgb, dtype=torch.float32)).norm(dim=-1) < 90  # (T, H, W)
    ys, xs = torch.meshgrid(torch.arange(video.shape[2]), torch.arange(video.shape[3]), indexing="ij")
    weight = near.float().sum(dim=(1, 2)).clamp(min=1)
    return torch.stack([(near * ys).sum(dim=(1, 2)) / weight, (near * xs).sum(dim=(1, 2)) / weight], 1).numpy()


def test_bundled_model_draws_the_default_prompt():
    # The default prompt is what `make demo` shows: a red object moving right on black.
    pipe = VideoPipeline.from_checkpoint(None)
    video = pipe(DEFAULT_PROMPT, seed=0, progress=False)
    centres = _centroids(video, COLORS["red"])
    assert centres[-1][1] - centres[0][1] > 2.0, centres  # pixels to the right
    background = (video.flatten(1).median(dim=1).values + 1) * 127.5  # most pixels are background
    assert np.abs(background.numpy() - BACKGROUNDS["black"]).max() < 40, background


def test_bundled_model_follows_colour_and_background():
    pipe = VideoPipeline.from_checkpoint(None)
    for colour, background in [("blue", "gray"), ("yellow", "navy"), ("green", "black")]:
        video = pipe(f"a {colour} circle moving left quickly on a {background} background", seed=1, progress=False)
        pixels = ((video.permute(1, 2, 3, 0) + 1) * 127.5).reshape(-1, 3)  # (N, 3)
        distance = {name: (pixels - torch.tensor(rgb, dtype=torch.float32)).norm(dim=-1) for name, rgb in COLORS.items()}
        nearest = torch.stack(list(distance.values())).argmin(dim=0)  # the palette colour closest to each pixel
        near_any = torch.stack(list(distance.values())).min(dim=0).values < 90
        counts = torch.bincount(nearest[near_any], minlength=len(COLORS))
        assert list(COLORS)[counts.argmax()] == colour, (colour, dict(zip(COLORS, counts.tolist())))
        median = pixels.median(dim=0).values
        assert (median - torch.tensor(BACKGROUNDS[background], dtype=torch.float32)).abs().max() < 40, (background, median)
