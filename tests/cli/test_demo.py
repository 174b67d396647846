"""The bundled model: it loads, it fits the size budget, and it draws what the prompt asks for."""

import numpy as np
import torch

from slidefusion.cli import main
from slidefusion.data import ShapeObject, ShapeScene, from_uint8, parse_caption, read_video, render
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
    rows, columns = -(-len(GRID_PROMPTS) // 2), 2
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


# The motion test (issue 16): the same noise, opposite words, opposite motion. Few Euler steps and
# one batch keep it fast; the layout of a moving shapes clip is settled in the first steps.
MOTION_STEPS = 8
MOTION_OBJECTS = [("red", "circle", "black"), ("blue", "square", "gray"), ("yellow", "triangle", "navy"),
                  ("green", "diamond", "black"), ("magenta", "circle", "gray"), ("cyan", "square", "navy"),
                  ("orange", "triangle", "black"), ("white", "diamond", "gray")]


def _displacements(pipe, direction: str) -> list[tuple[float, float]]:
    """Per seed 0-7: the detector's (dy, dx) from first to last frame where the object is present."""
    prompts = [f"{'an' if c[0] in 'aeiou' else 'a'} {c} {s} moving {direction} quickly on a {b} background"
               for c, s, b in MOTION_OBJECTS]
    videos = pipe.decode_batch(pipe.latents_batch(prompts, list(range(len(prompts))), steps=MOTION_STEPS))
    moves = []
    for video, (colour, _, _) in zip(videos, MOTION_OBJECTS):
        centres = detect(video, colour).centroid
        centres = centres[np.isfinite(centres).all(1)]
        moves.append(tuple(centres[-1] - centres[0]) if len(centres) >= 2 else (0.0, 0.0))
    return moves


def test_bundled_model_moves_the_way_the_prompt_says():
    pipe = VideoPipeline.from_checkpoint(None)
    moves = {d: _displacements(pipe, d) for d in ("left", "right", "up", "down")}
    left_right = sum(l[1] < 0 < r[1] for l, r in zip(moves["left"], moves["right"]))
    up_down = sum(u[0] < 0 < d[0] for u, d in zip(moves["up"], moves["down"]))
    assert left_right >= 6, moves
    assert up_down >= 6, moves


class _RenderingPipe:
    """Stands in for a model that follows prompts perfectly: it draws what each prompt says."""

    def latents_batch(self, prompts, seeds, steps):
        videos = []
        for prompt, seed in zip(prompts, seeds):
            scene = parse_caption(prompt)
            obj = scene.objects[0]
            start = 0.3 + 0.05 * seed  # a different place per seed
            shape = ShapeObject(obj.color, obj.shape, obj.direction, obj.speed, 0.1, start, 1 - start)
            videos.append(from_uint8(render(ShapeScene((shape,), scene.background), 8, 32, 32)))
        return torch.stack(videos)

    def decode_batch(self, latents):
        return latents


def test_the_motion_measure_passes_on_videos_that_follow_the_prompt():
    pipe = _RenderingPipe()
    left, right, up, down = (_displacements(pipe, d) for d in ("left", "right", "up", "down"))
    assert all(l[1] < 0 < r[1] for l, r in zip(left, right))
    assert all(u[0] < 0 < d[0] for u, d in zip(up, down))
