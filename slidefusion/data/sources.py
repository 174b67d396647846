"""Datasets of real files: sources (folders with their own settings), their scan, and the skip table.

    data:
      datasets:
        - root: clips/                 # videos and images, subfolders included (hidden names skipped)
          repeats: 2                   # each clip twice per epoch
          caption_extension: .txt      # clip.mp4 -> clip.txt (or clip.mp4.txt); captions.csv / .jsonl win
          frames: slide                # head | chunk | slide (+ stride) | uniform (+ count)
          stride: 8
          fps: 16                      # resample to 16 frames per second (frames dropped, never repeated)
        - root: stills/
          resolution: [832, 480]       # a fixed [width, height] for this source instead of aspect buckets

The single-folder keys (`data.root`, `data.frames`, `data.height`, `data.width`, `data.stride`) are
one source with head extraction, every `stride`-th frame, one bucket of that size.

`scan` looks at every file before anything is encoded: what it finds is either used (one or more
clips, see `frames` and `buckets`) or skipped for a reason, and the table of both is printed per
source. A source with no usable file, or any skip under `data.strict=true`, is a one-line error.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset

from slidefusion.core.errors import UserError, check
from slidefusion.data import frames as extraction
from slidefusion.data.buckets import Bucket, aspect_buckets, frame_bucket, nearest_bucket
from slidefusion.data.config import SourceConfig
from slidefusion.data.folder import _hidden, caption_table, resize_center_crop
from slidefusion.data.media import MEDIA_SUFFIXES, MediaInfo, is_supported, probe, read_windows

NO_CAPTION, UNREADABLE, TOO_SHORT, UNSUPPORTED = "no caption", "unreadable", "too short", "unsupported type"
TOO_SLOW, BAD_CAPTION = "slower than fps", "caption not UTF-8"
REASONS = (NO_CAPTION, UNREADABLE, TOO_SHORT, UNSUPPORTED, TOO_SLOW, BAD_CAPTION)  # table columns, in order
TABLES = ("captions.csv", "captions.jsonl")
RESIZE = "cover+centre-crop, bilinear antialiased"  # part of every cached clip's identity
PROBE_THREADS = 8  # probing waits on ffmpeg processes, not on Python


@dataclass(frozen=True)
class Rules:
    """What the model accepts: frame buckets, and aspect buckets (None: one fixed `size` (H, W)),
    sides in steps of `step` pixels."""

    frame_buckets: tuple[int, ...]
    size: tuple[int, int] | None
    area: int | None
    step: int

    def __post_init__(self):
        object.__setattr__(self, "_aspects", aspect_buckets(self.area, self.step) if self.area else None)

    def bucket(self, frames: int, height: int, width: int, fixed: tuple[int, int] | None) -> Bucket:
        """The bucket of a clip of `frames` x `height` x `width` (`fixed`: its source's size)."""
        h, w = fixed or (nearest_bucket(height, width, self._aspects) if self._aspects else self.size)
        return Bucket(frames, h, w)

    def sides(self) -> list[tuple[int, int]]:
        """Every (height, width) a clip can get: the aspect buckets, or the one fixed size."""
        return list(self._aspects or [self.size])


@dataclass
class Clip:
    """One training sample: frames `frames` (source indices) of `path`, in `bucket`."""

    path: Path
    caption: str
    frames: list[int]
    bucket: Bucket
    size: tuple[int, int]  # the file's (height, width)
    repeats: int = 1


@dataclass
class SourceReport:
    key: str
    root: Path
    found: int = 0
    used: int = 0
    clips: int = 0
    upscaled: int = 0  # clips whose file is smaller than their bucket on some side
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> "name: detail" per file

    def skip(self, reason: str, path: Path, detail: str = "") -> None:
        name = path.relative_to(self.root).as_posix()
        self.skipped.setdefault(reason, []).append(f"{name} ({detail})" if detail else name)


# ------------------------------------------------------------------------------------ captions
def _caption_tables(root: Path, key: str) -> dict[str, str]:
    try:
        return caption_table(root)
    except UnicodeDecodeError as err:
        raise UserError(f"{key}.root: a caption table in {root} is not UTF-8 text ({err.reason} at byte "
                        f"{err.start}); save it as UTF-8") from None


def _caption(path: Path, root: Path, table: dict[str, str], ext: str) -> str | None:
    """The file's caption ('' for an empty one); None when it has none. UnicodeDecodeError propagates."""
    text = table.get(path.relative_to(root).as_posix())
    for sidecar in (path.with_suffix(ext), path.with_name(path.name + ext)):
        if text is None and sidecar.is_file():
            text = sidecar.read_text(encoding="utf-8").strip()
    return text


def _is_caption_file(path: Path, root: Path, ext: str) -> bool:
    return path.suffix.lower() == ext.lower() or (path.parent == root and path.name in TABLES)


def _files(root: Path, ext: str) -> list[Path]:
    found = [p for p in root.rglob("*") if p.is_file() and not _hidden(p.relative_to(root))
             and not _is_caption_file(p, root, ext)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


# ------------------------------------------------------------------------------------ the scan
def _probe_all(paths: list[Path]) -> list[MediaInfo | UserError]:
    def one(path: Path):
        try:
            return probe(path)
        except UserError as error:
            return error

    with ThreadPoolExecutor(min(PROBE_THREADS, max(1, len(paths)))) as pool:
        return list(pool.map(one, paths))


def scan_source(source: SourceConfig, key: str, rules: Rules) -> tuple[list[Clip], SourceReport]:
    """The clips of one source and its row of the table (no error for skips: see `check_reports`)."""
    root = Path(source.root).expanduser()
    check(root.is_dir(), f"{key}.root: no such folder: {root}")
    report, ext = SourceReport(key, root), source.caption_extension
    table = _caption_tables(root, key)
    candidates = []
    for path in _files(root, ext):
        report.found += 1
        if not is_supported(path):
            report.skip(UNSUPPORTED, path)
            continue
        try:
            caption = _caption(path, root, table, ext)
        except UnicodeDecodeError:
            report.skip(BAD_CAPTION, path)
            continue
        if not caption:
            report.skip(NO_CAPTION, path, "empty" if caption == "" else "")
            continue
        candidates.append((path, caption))
    clips = []
    for (path, caption), info in zip(candidates, _probe_all([p for p, _ in candidates])):
        if isinstance(info, UserError):
            report.skip(UNREADABLE, path, str(info).split(": ", 1)[-1])
            continue
        made = _clips_of(path, caption, info, source, rules, report)
        if made:
            report.used += 1
            report.clips += len(made)
            clips += made
    return clips, report


def _clips_of(path: Path, caption: str, info: MediaInfo, source: SourceConfig, rules: Rules,
              report: SourceReport) -> list[Clip]:
    line = extraction.timeline(info.frames, info.fps, source.fps, source.frame_step)
    if line is None:
        report.skip(TOO_SLOW, path, f"{info.fps:g} fps < fps={source.fps:g}")
        return []
    length = frame_bucket(len(line), list(rules.frame_buckets))
    if length is None:
        report.skip(TOO_SHORT, path, f"{len(line)} frame{'s' * (len(line) != 1)}")
        return []
    fixed = (source.resolution[1], source.resolution[0]) if source.resolution else None
    bucket = rules.bucket(length, info.height, info.width, fixed)
    windows = extraction.windows(line, length, source.frames, source.stride, source.count)
    if bucket.height > info.height or bucket.width > info.width:
        report.upscaled += len(windows)
    return [Clip(path, caption, w, bucket, (info.height, info.width), source.repeats) for w in windows]


def check_reports(reports: list[SourceReport], strict: bool) -> None:
    """The errors a scan can end in: nothing found, a source with no usable file, a skip when strict."""
    for report in reports:
        if report.found == 0:
            raise UserError(f"{report.key}.root={report.root} holds no image or video files "
                            f"(supported: {' '.join(MEDIA_SUFFIXES)})")
        if report.used == 0:
            reasons = ", ".join(f"{len(v)} {k}" for k, v in report.skipped.items())
            raise UserError(f"{report.key}.root={report.root}: none of its {report.found} files is usable ({reasons}); "
                            f"e.g. {_first_skip(report)}")
    if strict:
        skipped = [(r, reason, names) for r in reports for reason, names in r.skipped.items()]
        if skipped:
            total = sum(len(names) for _, _, names in skipped)
            report, reason, names = skipped[0]
            raise UserError(f"data.strict=true: {total} file(s) skipped, e.g. {report.root / names[0]} ({reason}); "
                            "fix them, or set data.strict=false to train on the rest")


def _first_skip(report: SourceReport) -> str:
    reason, names = next(iter(report.skipped.items()))
    return f"{names[0]}: {reason}"


def format_table(reports: list[SourceReport]) -> str:
    """The skip table printed before any encoding: one row per source, then each skipped file."""
    reasons = [r for r in REASONS if r in (NO_CAPTION, UNREADABLE, TOO_SHORT, UNSUPPORTED)
               or any(r in rep.skipped for rep in reports)]
    rows = [("source", "found", "used", "clips", *reasons)]
    rows += [(f"{r.key}.root={r.root}", str(r.found), str(r.used), str(r.clips),
              *(str(len(r.skipped.get(reason, []))) for reason in reasons)) for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    for report in reports:
        for reason, names in report.skipped.items():
            shown = ", ".join(names[:5]) + (f", and {len(names) - 5} more" if len(names) > 5 else "")
            lines.append(f"  skipped in {report.root} ({reason}): {shown}")
        if report.upscaled:
            lines.append(f"  note: {report.upscaled} clip(s) of {report.root} are upscaled to their bucket "
                         "(the file is smaller on some side)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the dataset
class ClipSet(Dataset):
    """The scanned clips as a dataset: item i is {"video": float32 (3, F, H, W) in [-1, 1] of its
    bucket's size, "caption": str}. `load(indices)` decodes several, each file once."""

    def __init__(self, clips: list[Clip]):
        self.clips = clips
        self.captions = [c.caption for c in clips]
        self.buckets = [c.bucket for c in clips]
        self.repeats = [c.repeats for c in clips]

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int) -> dict:
        return {"video": next(iter(self.load([index])))[1], "caption": self.captions[index]}

    def load(self, indices: list[int]):
        """Yield (index, video (3, F, H, W)) for `indices`, grouped by file."""
        by_file: dict[Path, list[int]] = {}
        for index in indices:
            by_file.setdefault(self.clips[index].path, []).append(index)
        for path, members in by_file.items():
            for number, frames in read_windows(path, [self.clips[i].frames for i in members]):
                clip = self.clips[members[number]]
                yield members[number], to_bucket(frames, clip.bucket)

    def identity(self, index: int) -> dict:
        """What determines clip `index` before the VAE (its cache key)."""
        clip = self.clips[index]
        stat = clip.path.stat()
        frames = hashlib.sha256(",".join(map(str, clip.frames)).encode()).hexdigest()[:16]
        return {"kind": "media", "file": str(clip.path.resolve()), "size": stat.st_size, "mtime": stat.st_mtime_ns,
                "frames": frames, "bucket": [clip.bucket.frames, clip.bucket.height, clip.bucket.width],
                "resize": RESIZE}


def to_bucket(frames, bucket: Bucket) -> torch.Tensor:
    """uint8 (T, h, w, 3) -> float32 (3, T, H, W) in [-1, 1], resized to cover the bucket, centre-cropped."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float()  # (T, 3, h, w) in [0, 255]
    x = resize_center_crop(x, bucket.height, bucket.width)  # (T, 3, H, W)
    return x.permute(1, 0, 2, 3).div(127.5).sub(1.0).clamp(-1.0, 1.0).contiguous()


def scan(sources: list[tuple[SourceConfig, str]], rules: Rules, strict: bool) -> tuple[ClipSet, list[SourceReport]]:
    """Every source scanned; the table's errors raised (see `check_reports`)."""
    check(len(sources) > 0, "data.datasets=[] is empty; list at least one source, e.g. [{root: clips/}]")
    clips, reports = [], []
    for source, key in sources:
        found, report = scan_source(source, key, rules)
        clips += found
        reports.append(report)
    check_reports(reports, strict)
    return ClipSet(clips), reports

