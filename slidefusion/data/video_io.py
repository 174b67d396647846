"""Video files in and out: H.264 .mp4 through imageio-ffmpeg, looping .gif through Pillow.

In memory a video is either a float tensor (3, T, H, W) in [-1, 1] (what models see) or uint8 numpy
(T, H, W, 3) (what files hold); `to_uint8` and `from_uint8` convert between them.
"""

import math
import os
import re
import uuid
from pathlib import Path
from collections.abc import Callable

import imageio.v2 as imageio
import numpy as np
import torch
from PIL import Image, ImageSequence

from slidefusion.errors import UserError, check

MIN_SIDE = 256  # default upscaling target: model outputs of 32x32 are unreadable on screen
GIF_MAX_REPEAT = 100  # bounds memory when a GIF holds one very long frame (e.g. a 10 s pause)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def to_uint8(video) -> np.ndarray:
    """A video as uint8 numpy (T, H, W, 3).

    Accepts a float tensor or array (3, T, H, W) in [-1, 1] (clamped; NaN becomes mid-grey) or a
    uint8 array (T, H, W, 3), which is returned as is (contiguous).
    """
    if isinstance(video, np.ndarray) and video.dtype == np.uint8:
        check(video.ndim == 4 and video.shape[-1] == 3 and video.size > 0,
              f"video: a uint8 array must be (T, H, W, 3) and non-empty, got shape {video.shape}")
        return np.ascontiguousarray(video)
    if isinstance(video, np.ndarray):
        video = torch.from_numpy(video)
    check(isinstance(video, torch.Tensor),
          f"video must be a tensor or numpy array, got {type(video).__name__}")
    check(video.ndim == 4 and video.shape[0] == 3 and video.numel() > 0,
          f"video: a float tensor must be (3, T, H, W) and non-empty, got shape {tuple(video.shape)}")
    check(video.is_floating_point(),
          f"video: expected uint8 (T, H, W, 3) or float (3, T, H, W), got {video.dtype}")
    x = torch.nan_to_num(video.detach().to("cpu", torch.float32), nan=0.0).clamp(-1.0, 1.0)
    x = x.add(1.0).mul(127.5).round().to(torch.uint8)
    return x.permute(1, 2, 3, 0).contiguous().numpy()


def from_uint8(video: np.ndarray) -> torch.Tensor:
    """uint8 (T, H, W, 3) -> float32 tensor (3, T, H, W) in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(video))
    return x.permute(3, 0, 1, 2).float().div(127.5).sub(1.0)


# ---------------------------------------------------------------------------------------------
# Writing


def upscale_factor(height: int, width: int, min_side: int = MIN_SIDE) -> int:
    """The smallest integer factor that brings the shorter side to at least `min_side` pixels."""
    return max(1, math.ceil(min_side / min(height, width)))


def _upscale(frames: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour upscaling of (T, H, W, 3) by an integer factor: keeps pixels crisp."""
    if factor == 1:
        return frames
    return frames.repeat(factor, axis=1).repeat(factor, axis=2)


def _pad_even(frames: np.ndarray) -> np.ndarray:
    """Repeat the last row/column where H or W is odd: yuv420p stores chroma per 2x2 block."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not (pad_h or pad_w):
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def _write_mp4(path: Path, frames: np.ndarray, fps: float) -> None:
    # macro_block_size=1 stops imageio from resizing to multiples of 16; we pad to even ourselves.
    # quality=8 maps to x264 crf ~10: flat synthetic colours survive with little bleeding.
    writer = imageio.get_writer(
        path, format="FFMPEG", mode="I", fps=fps, codec="libx264", pixelformat="yuv420p",
        macro_block_size=1, quality=8, ffmpeg_log_level="error",
    )
    with writer:
        for frame in _pad_even(frames):
            writer.append_data(frame)


def gif_frame_ms(fps: float) -> int:
    """Per-frame GIF duration in ms: GIF stores centiseconds, and players slow frames < 20 ms."""
    return 10 * max(2, round(100 / fps))


def _write_gif(path: Path, frames: np.ndarray, fps: float) -> None:
    # Pillow merges a run of identical frames into one longer frame. The comment records the
    # single-frame duration so that read_video can split runs again even when every frame is in one.
    ms = gif_frame_ms(fps)
    images = [Image.fromarray(f) for f in frames]
    images[0].save(path, format="GIF", save_all=True, append_images=images[1:],
                   duration=ms, loop=0, comment=f"slidefusion frame_ms={ms}".encode())


_WRITERS: dict[str, Callable[[Path, np.ndarray, float], None]] = {".mp4": _write_mp4, ".gif": _write_gif}


def _temp_path(out: Path) -> Path:
    """A hidden sibling of `out` with the same suffix (ffmpeg picks the container from it)."""
    return out.with_name(f".{out.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{out.suffix}")


def check_video_path(out: Path) -> str:
    """The writer's suffix for `out`, or a UserError listing the formats we write."""
    suffix = Path(out).suffix.lower()
    check(suffix in _WRITERS, f"out must end in {' or '.join(_WRITERS)}, got {str(out)!r}")
    return suffix


def write_video(path: str | os.PathLike, video, fps: float = 8, upscale: int | None = None) -> Path:
    """Write `video` (see `to_uint8`) to `path` atomically; returns the path.

    The suffix picks the format: .mp4 is H.264/yuv420p (sizes padded to even by repeating the last
    row/column), .gif loops forever. `upscale` is an integer nearest-neighbour factor; None picks
    the smallest one that makes the shorter side >= 256 px. The file is written next to `path` under
    a temporary name and renamed into place, so a crash never leaves a half-written video.
    """
    out = Path(path)
    suffix = check_video_path(out)
    check(_is_number(fps) and fps > 0, f"fps must be a number > 0, got {fps!r}")
    check(upscale is None or (_is_int(upscale) and upscale >= 1),
          f"upscale must be an int >= 1 or None, got {upscale!r}")
    frames = to_uint8(video)
    factor = upscale_factor(*frames.shape[1:3]) if upscale is None else upscale
    frames = _upscale(frames, factor)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"out: cannot create folder {out.parent}: {err.strerror or err}") from err
    from slidefusion.io.diskfull import writing

    tmp = _temp_path(out)
    with writing(f"the video {out.name}", out.parent, None, "no partial video was left"):
        try:
            _WRITERS[suffix](tmp, frames, fps)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------------------------------
# Reading


def _gif_repeats(durations: list[int], base: int | None) -> list[int]:
    """How many times to repeat each GIF frame so frames are evenly spaced in time.

    Encoders (Pillow included) store a run of identical frames as one frame with the summed
    duration; dividing by the single-frame duration `base` (when unknown: the shortest one) restores
    the run.
    """
    positive = [d for d in durations if d > 0]
    base = base or (min(positive) if positive else None)
    if base is None:
        return [1] * len(durations)
    return [min(GIF_MAX_REPEAT, max(1, round(d / base))) for d in durations]


def _gif_base_ms(info: dict) -> int | None:
    """The single-frame duration that `_write_gif` records in the comment, if this is one of ours."""
    match = re.search(rb"slidefusion frame_ms=(\d+)", info.get("comment") or b"")
    return int(match[1]) if match and int(match[1]) > 0 else None


def _read_gif(path: Path, limit: int | None) -> list[np.ndarray]:
    # Decode every frame even under `limit`: the repeat counts need all durations. GIFs are small.
    frames, durations = [], []
    with Image.open(path) as image:
        base = _gif_base_ms(image.info)
        for frame in ImageSequence.Iterator(image):
            frames.append(np.asarray(frame.convert("RGB")))
            durations.append(int(frame.info.get("duration") or 0))
    expanded = [f for f, n in zip(frames, _gif_repeats(durations, base)) for _ in range(n)]
    return expanded[:limit]


def _read_ffmpeg(path: Path, limit: int | None) -> list[np.ndarray]:
    frames = []
    with imageio.get_reader(path, format="FFMPEG") as reader:
        for frame in reader:
            frames.append(np.asarray(frame)[..., :3])
            if limit is not None and len(frames) >= limit:
                break  # stop decoding early: datasets often need only the first clip
    return frames


# What Pillow and imageio-ffmpeg raise for a broken file. TypeError, AttributeError and friends are
# left out on purpose: they are bugs in this module, not in the user's file.
_DECODE_ERRORS = (OSError, RuntimeError, ValueError, IndexError, KeyError, EOFError, SyntaxError)


def _one_line(err: Exception) -> str:
    """An exception message squeezed into one line.

    imageio-ffmpeg appends ffmpeg's whole stderr (banner first); its last line holds the cause.
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if "=== stderr ===" in lines and lines[-1] != "=== stderr ===":
        return f"{lines[0]} (ffmpeg: {lines[-1]})"
    return lines[0]


def read_video(path: str | os.PathLike, frames: int | None = None) -> np.ndarray:
    """The first `frames` frames (all when None) of a video file, uint8 (T, H, W, 3).

    .gif goes through Pillow (runs of merged identical frames are expanded again); anything else
    through ffmpeg (.mp4, .webm, .avi, ...). A missing, unreadable or empty file raises UserError.
    """
    check(frames is None or (_is_int(frames) and frames >= 1),
          f"frames must be an int >= 1 or None, got {frames!r}")
    p = Path(path)
    if not p.is_file():
        raise UserError(f"cannot read video {p}: no such file")
    try:
        decoded = _read_gif(p, frames) if p.suffix.lower() == ".gif" else _read_ffmpeg(p, frames)
    except _DECODE_ERRORS as err:
        raise UserError(f"cannot read video {p}: {_one_line(err)}") from err
    if not decoded:
        raise UserError(f"cannot read video {p}: it holds no frames")
    return np.stack(decoded)
