"""Which frames of a file make training clips: the time axis (fps resampling, a frame step) and the
windows taken from it (head, chunk, slide, uniform).

A file of `n` frames at `source_fps` is first read as a timeline: with a target `fps`, timeline
frame j is source frame round(j * source_fps / fps) (frames are dropped, never repeated: a source
slower than `fps` is refused, see `timeline`); without one, every `step`-th frame. A clip of
`length` timeline frames is then taken as the extraction mode says:

    head      one clip from the start
    chunk     consecutive clips, end to end, as many as fit
    slide     clips starting every `stride` frames, as many as fit
    uniform   `count` clips with evenly spaced starts (fewer if the timeline has fewer distinct starts)

Nothing is padded: a timeline shorter than `length` gives no clip.
"""

from __future__ import annotations

import math

import numpy as np

MODES = ("head", "chunk", "slide", "uniform")  # `SourceConfig.frames` (checked there)


def timeline(frames: int, source_fps: float | None, fps: float | None, step: int = 1) -> np.ndarray | None:
    """Source frame indices of the timeline (int64), or None when `fps` asks for more frames per
    second than the source has (the caller reports the file; frames are never repeated).
    Sources that do not state their rate (images, some GIFs) are read frame by frame."""
    if fps is None or source_fps is None or frames == 1:
        return np.arange(0, frames, step, dtype=np.int64)
    if source_fps + 1e-6 < fps:
        return None
    ratio = source_fps / fps
    count = math.floor((frames - 1) / ratio + 1e-9) + 1
    return np.minimum(np.round(np.arange(count) * ratio).astype(np.int64), frames - 1)


def starts(available: int, length: int, mode: str, stride: int = 1, count: int = 1) -> list[int]:
    """Starting positions on a timeline of `available` frames of clips of `length` frames."""
    if length > available:
        return []
    last = available - length
    if mode == "head":
        return [0]
    if mode == "chunk":
        return list(range(0, last + 1, length))
    if mode == "slide":
        return list(range(0, last + 1, stride))
    assert mode == "uniform", mode
    return sorted({int(round(x)) for x in np.linspace(0, last, count)})


def windows(line: np.ndarray, length: int, mode: str, stride: int = 1, count: int = 1) -> list[list[int]]:
    """The source frame indices of every clip of `length` frames taken from the timeline `line`."""
    return [line[s:s + length].tolist() for s in starts(len(line), length, mode, stride, count)]
