"""Folders of generated media for tests and benchmarks: videos and images of mixed sizes, lengths and
file types, with captions, written with imageio-ffmpeg and Pillow.

    write_media(root / "clip.mov", frames=9, height=48, width=80)     # any supported suffix
    make_folder(root, [("a.mp4", 9, 48, 80), ("still.png", 1, 64, 48)], captions=True)

Pixels are smooth colour ramps that move with the frame number, so frame order and crops show.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

CODECS = {".mp4": "libx264", ".mov": "libx264", ".mkv": "libx264", ".webm": "libvpx", ".avi": "mpeg4"}


def ramp(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 (T, H, W, 3): a colour ramp that shifts with the frame number."""
    y, x = np.mgrid[0:height, 0:width]
    t = np.arange(frames)[:, None, None]
    base = (seed * 37) % 256
    red = (x * 255 // max(1, width - 1) + 9 * t + base) % 256
    green = (y * 255 // max(1, height - 1) + 5 * t) % 256
    blue = np.broadcast_to((20 * t + base) % 256, red.shape)
    return np.stack([red, green, blue], axis=-1).astype(np.uint8)


def write_media(path: str | Path, frames: int, height: int, width: int, fps: float = 16, seed: int = 0) -> Path:
    """One file of `frames` frames (an image suffix: 1 frame) at `fps`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    video = ramp(frames, height, width, seed)
    suffix = path.suffix.lower()
    if suffix in (".png", ".jpg", ".jpeg", ".webp"):
        Image.fromarray(video[0]).save(path)
    elif suffix == ".gif":
        images = [Image.fromarray(f) for f in video]
        images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    else:
        import imageio.v2 as imageio

        writer = imageio.get_writer(path, format="FFMPEG", fps=fps, codec=CODECS[suffix], macro_block_size=1,
                                    ffmpeg_log_level="error", pixelformat="yuv420p")
        with writer:
            for frame in video:
                writer.append_data(frame)
    return path


def make_folder(root: str | Path, files: list[tuple], captions: bool | dict = True, fps: float = 16) -> Path:
    """`files`: (name, frames, height, width); each captioned by a NAME.txt beside it ("clip i")
    unless `captions` is False, or only those named in a dict name -> caption."""
    root = Path(root)
    for index, (name, frames, height, width) in enumerate(files):
        path = write_media(root / name, frames, height, width, fps, seed=index)
        text = f"clip {index}" if captions is True else captions.get(name) if isinstance(captions, dict) else None
        if text is not None:
            path.with_suffix(".txt").write_text(text)
    return root
