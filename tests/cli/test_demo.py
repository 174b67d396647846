"""The bundled model: it loads, it fits the size budget, and it draws what the prompt asks for."""

import numpy as np
import torch

from slidefusion.cli import main
from slidefusion.data import read_video
from slidefusion.demo import CELL_SCALE, GAP, GRID_PROMPTS, LABEL_HEIGHT, grid_label, label_grid
from slidefusion.data.shapes import BACKGROUNDS
from slidefusion.eval import detect, score
from slidefusion.pipeline import DEFAULT_PROMPT, VideoPipeline, bundled_checkpoint


def test_bundled_model_is_small_enough_to_ship():
    size = sum(f.stat().st_size for f in bundled_checkpoint().iterdir())
    assert 0 < size <= 25 * 2**20


def test_demo_writes_mp4_gif_and_a_labelled_grid(tmp_path):
    out = tmp_path / "demo.mp4"
    assert main(["demo", "--steps", "3", "--out", str(out), "--quiet"]) == 0
    assert out.stat().st_size > 0 and out.with_suffix(".gif").stat().st_size > 0
    grid = read_video(tmp_path / "demo-grid.gif")  # (T, H, W, 3) uint8
    rows, columns = -(-len(GRID_PROMPTS) // 3), 3
    assert grid.shape == (8, rows * (32 * CELL_SCALE + LABEL_HEIGHT + GAP) + GAP,
                          columns * (32 * CELL_SCALE + GAP) + GAP, 3)
    label_band = grid[0, GAP + 32 * CELL_SCALE:GAP + 32 * CELL_SCALE + LABEL_HEIGHT, GAP:GAP + 32 * CELL_SCALE]
    assert (label_band.max(-1) < 100).sum() > 30  # dark text on white under the first cell


def test_grid_places_each_video_above_its_label():
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (200, 200, 0)]
    videos = [np.broadcast_to(np.array(c, dtype=np.uint8), (2, 5, 7, 3)).copy() for c in colours]
    grid = label_grid(videos, [("a", "b")] * 4, columns=3, scale=2)
    assert grid.shape == (2, 2 * (10 + LABEL_HEIGHT + GAP) + GAP, 3 * (14 + GAP) + GAP, 3)
    for i, colour in enumerate(colours):
        top, left = GAP + (i // 3) * (10 + LABEL_HEIGHT + GAP), GAP + (i % 3) * (14 + GAP)
        assert (grid[:, top:top + 10, left:left + 14] == colour).all(), i
        assert (grid[:, top + 10:top + 10 + LABEL_HEIGHT, left:left + 14] != colour).any(-1).all(), i
    assert grid_label(DEFAULT_PROMPT) == ("red circle", "right, quickly")
    assert all(len(line) <= 20 for line in grid_label("a lighthouse in a storm at night, painted in oils"))


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
