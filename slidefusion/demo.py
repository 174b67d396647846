"""`slidefusion demo`: the bundled model on its default prompt, and a labelled grid of prompts that
differ in colour, shape and direction, all sampled in one batch from the same seed."""

import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from slidefusion.data.shapes import parse_caption
from slidefusion.data.video_io import check_video_path, to_uint8, write_video
from slidefusion.core.errors import UserError, check
from slidefusion.pipeline import DEFAULT_PROMPT, VideoPipeline
from slidefusion.core.validate import output_path

# Every colour, shape and main direction of the grid differs from its neighbours'; the first is
# the default prompt, so the single demo video is the grid's first cell.
GRID_PROMPTS = (
    DEFAULT_PROMPT,
    "a blue square moving left quickly on a gray background",
    "a yellow triangle moving up quickly on a navy background",
    "a green diamond moving down quickly on a black background",
)  # four keep `make demo` well under a minute on 2 shared cores (one batch of 4 x 2 for guidance)
CELL_SCALE = 4  # nearest-neighbour upscaling of each 32x32 video
LABEL_HEIGHT = 26  # pixels under each cell for its two label lines
GAP = 4  # pixels between cells


def grid_label(prompt: str, width: int = 20) -> tuple[str, str]:
    """Two short lines naming what `prompt` asks for: ("red circle", "right, quickly"); a prompt
    outside the moving-shapes grammar is cut into two lines of about `width` characters."""
    try:
        obj = parse_caption(prompt).objects[0]
    except UserError:
        head, _, tail = prompt[:2 * width].rpartition(" ") if len(prompt) > width else (prompt, "", "")
        return (head, tail) if len(head) <= width else (prompt[:width], prompt[width:2 * width])
    return f"{obj.color} {obj.shape}", obj.direction + (f", {obj.speed}" if obj.speed else "")


def label_grid(videos, labels: list[tuple[str, ...]], columns: int = 2, scale: int = CELL_SCALE) -> np.ndarray:
    """Videos side by side, each with its label lines underneath: uint8 (T, H_grid, W_grid, 3).

    `videos` are (3, T, H, W) in [-1, 1] or uint8 (T, H, W, 3), all of one size; `labels` holds
    one tuple of text lines per video. Cells are upscaled `scale` times (nearest neighbour).
    """
    frames = [to_uint8(v) for v in videos]
    check(len(frames) == len(labels) and len(frames) > 0, f"{len(frames)} videos but {len(labels)} labels")
    check(all(f.shape == frames[0].shape for f in frames), "every video of a grid must have the same size")
    t, h, w, _ = frames[0].shape
    cell_h, cell_w = h * scale + LABEL_HEIGHT, w * scale
    rows = -(-len(frames) // columns)
    page = Image.new("RGB", (columns * (cell_w + GAP) + GAP, rows * (cell_h + GAP) + GAP), (255, 255, 255))
    draw, font = ImageDraw.Draw(page), ImageFont.load_default()
    corners = [(GAP + (i // columns) * (cell_h + GAP), GAP + (i % columns) * (cell_w + GAP)) for i in range(len(frames))]
    for (top, left), lines in zip(corners, labels):
        for j, line in enumerate(lines):
            draw.text((left + 2, top + h * scale + 1 + 12 * j), line, fill=(0, 0, 0), font=font)
    grid = np.repeat(np.asarray(page)[None], t, axis=0)  # (T, H_grid, W_grid, 3): labels on every frame
    for (top, left), video in zip(corners, frames):
        grid[:, top:top + h * scale, left:left + cell_w] = video.repeat(scale, axis=1).repeat(scale, axis=2)
    return grid


def run_demo(out: str | Path, prompt: str = DEFAULT_PROMPT, grid_prompts=GRID_PROMPTS, *, steps: int = 30,
             guidance: float = 4.0, seed: int = 0, frames: int | None = None, height: int | None = None,
             width: int | None = None, device: str = "cpu", progress: bool = True) -> list[Path]:
    """Write OUT.mp4 and OUT.gif for `prompt`, and OUT-grid.gif for `prompt` and `grid_prompts`
    (the first grid cell is `prompt`), every video from noise seed `seed`, all in one batch.
    Sizes in pixels default to the model's training size. Returns the paths written."""
    out = Path(out)
    paths = [out.with_suffix(".mp4"), out.with_suffix(".gif"), out.with_name(f"{out.stem}-grid.gif")]
    for path in paths:  # a bad file name must fail before sampling, not after
        check_video_path(path)
        output_path(path, "--out")
    prompts = [prompt, *(p for p in grid_prompts if p != prompt)][:len(grid_prompts)]
    labels = [grid_label(p) for p in prompts]
    start = time.perf_counter()
    pipe = VideoPipeline.from_checkpoint(None, device=device)
    latents = pipe.latents_batch(prompts, [seed] * len(prompts), frames=frames, height=height, width=width,
                                 steps=steps, guidance=guidance, progress=progress)
    videos = pipe.decode_batch(latents)
    fps = pipe.config.data.fps
    write_video(paths[0], videos[0], fps=fps)
    write_video(paths[1], videos[0], fps=fps)
    write_video(paths[2], label_grid(videos, labels), fps=fps, upscale=1)
    for path in paths:
        print(f"wrote {path}")
    print(f"{len(prompts)} prompts, {videos.shape[2]} frames of {videos.shape[3]}x{videos.shape[4]}, seed {seed}, "
          f"in {time.perf_counter() - start:.1f} s")
    return paths
