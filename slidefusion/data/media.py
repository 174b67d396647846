"""Reading the files of a dataset: images as one-frame clips, videos through ffmpeg, GIFs through Pillow.

    info = probe(path)                    # MediaInfo(frames, fps, height, width): cheap, checked
    for window, frames in read_windows(path, [[0, 1, 2], [2, 3, 4]]):
        ...                               # uint8 (T, H, W, 3) per window, one decode of the file

`probe` reads what a dataset scan needs before any encoding, and fails (a `UserError`) on a file
that cannot be read: images are decoded whole; a video's header is parsed, its first frame decoded,
and its frames counted from the container's packets (`ffmpeg -c copy`, no decoding), so a scan of
long videos costs a fraction of their decoding. A video damaged past its first frame is found
when it is decoded for the cache, and that error names the file too.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from slidefusion.data.video_io import _DECODE_ERRORS, _gif_base_ms, _gif_repeats, _one_line, _read_gif
from slidefusion.core.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".gif")
MEDIA_SUFFIXES = IMAGE_SUFFIXES + VIDEO_SUFFIXES
COUNT_TIMEOUT_S = 120  # counting packets reads the file once; a stuck ffmpeg must not hang the scan


@dataclass(frozen=True)
class MediaInfo:
    """What a scan knows of a file: frames (1 for an image), frames per second (None for an image
    or a video that does not say), and the size in pixels."""

    frames: int
    fps: float | None
    height: int
    width: int

    @property
    def is_image(self) -> bool:
        return self.fps is None and self.frames == 1


def is_supported(path: Path) -> bool:
    return path.suffix.lower() in MEDIA_SUFFIXES


def _image_info(path: Path) -> MediaInfo:
    with Image.open(path) as image:
        image.load()  # decodes the pixels: a truncated file fails here, not in the cache
        width, height = image.size
    return MediaInfo(1, None, height, width)


def _gif_info(path: Path) -> MediaInfo:
    durations = []
    with Image.open(path) as image:
        base = _gif_base_ms(image.info)
        width, height = image.size
        for index in range(getattr(image, "n_frames", 1)):
            image.seek(index)
            durations.append(int(image.info.get("duration") or 0))
        image.seek(0)
        image.convert("RGB")  # the first frame decodes
    positive = [d for d in durations if d > 0]
    unit = base or (min(positive) if positive else None)
    return MediaInfo(sum(_gif_repeats(durations, base)), 1000.0 / unit if unit else None, height, width)


def _count_packets(path: Path) -> int:
    """Frames of the first video stream, counted from its packets without decoding them."""
    import imageio_ffmpeg

    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-i", str(path), "-map", "0:v:0", "-c", "copy",
               "-f", "null", "-"]
    try:
        done = subprocess.run(command, capture_output=True, timeout=COUNT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"counting its frames took over {COUNT_TIMEOUT_S} s") from None
    text = done.stderr.decode(errors="replace").replace("\r", "\n")
    counts = [line for line in text.splitlines() if line.startswith("frame=")]
    if done.returncode != 0 or not counts:
        last = [line for line in text.splitlines() if line.strip()]
        raise RuntimeError(f"ffmpeg: {last[-1].strip() if last else 'no video stream'}")
    return int(counts[-1].split("=", 1)[1].split()[0])


def _video_info(path: Path) -> MediaInfo:
    import imageio_ffmpeg

    frames = imageio_ffmpeg.read_frames(str(path))
    try:
        meta = next(frames)
        next(frames)  # the first frame decodes
    except StopIteration:
        raise RuntimeError("it holds no frames") from None
    finally:
        frames.close()
    width, height = meta["size"]
    fps = float(meta.get("fps") or 0) or None
    return MediaInfo(_count_packets(path), fps, int(height), int(width))


def probe(path: str | os.PathLike) -> MediaInfo:
    """The `MediaInfo` of an image or video file, or a UserError saying why it cannot be read."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in MEDIA_SUFFIXES:
        raise UserError(f"cannot read {path}: unsupported type {suffix or '(none)'}; supported: "
                        f"{' '.join(MEDIA_SUFFIXES)}")
    try:
        if suffix in IMAGE_SUFFIXES:
            info = _image_info(path)
        else:
            info = _gif_info(path) if suffix == ".gif" else _video_info(path)
    except (*_DECODE_ERRORS, Image.DecompressionBombError) as err:
        raise UserError(f"cannot read {path}: {_one_line(err)}") from err
    if info.frames < 1 or info.height < 1 or info.width < 1:
        raise UserError(f"cannot read {path}: it holds no frames")
    return info


def _frames_of(path: Path):
    """Every frame of a file in order, uint8 (H, W, 3), decoded lazily."""
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        with Image.open(path) as image:
            yield np.asarray(image.convert("RGB"))
        return
    if suffix == ".gif":
        yield from _read_gif(path, None)  # GIFs are small: their run lengths need every duration anyway
        return
    import imageio_ffmpeg

    # passthrough: every decoded frame once, as the packet count of `probe` counted them (ffmpeg's
    # default would duplicate or drop frames of a variable-rate video to a constant rate)
    frames = imageio_ffmpeg.read_frames(str(path), output_params=["-fps_mode", "passthrough"])
    try:
        width, height = next(frames)["size"]
        for data in frames:
            yield np.frombuffer(data, dtype=np.uint8).reshape(height, width, 3)
    finally:
        frames.close()


def read_windows(path: str | os.PathLike, windows: list[list[int]]):
    """Yield (window index, uint8 (T, H, W, 3)) for each window of frame indices, in the order their
    last frame is reached, decoding the file once and holding only frames some open window needs.
    A file with fewer frames than a window asks for is a UserError (never padded)."""
    path = Path(path)
    needed: dict[int, list[int]] = {}
    for number, window in enumerate(windows):
        for index in window:
            needed.setdefault(int(index), []).append(number)
    closing = {number: max(window) for number, window in enumerate(windows)}
    held: dict[int, np.ndarray] = {}
    last = max(needed) if needed else -1
    position = -1
    try:
        for position, frame in enumerate(_frames_of(path)):
            if position in needed:
                held[position] = frame
            for number in [n for n, end in closing.items() if end == position]:
                yield number, np.stack([held[int(i)] for i in windows[number]])
                del closing[number]
                for index in set(windows[number]):
                    if all(n not in closing for n in needed[int(index)]):
                        held.pop(int(index), None)
            if position >= last:
                return
    except _DECODE_ERRORS as err:
        raise UserError(f"cannot read {path}: {_one_line(err)}") from err
    raise UserError(f"cannot read {path}: it ended after {position + 1} frames, but frame {last} was found when "
                    "the dataset was scanned; the file changed or is damaged")
