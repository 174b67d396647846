"""A folder of real captioned videos as a dataset of fixed-size clips.

Layout: video files (.mp4, .gif, .webm, .avi; subfolders allowed, hidden files skipped) under
`root`, and captions from any of
  - `root/captions.csv` with columns `file,caption` (`file` relative to root, "/"-separated),
  - `root/captions.jsonl` with one {"file": ..., "caption": ...} object per line,
  - a text file next to the video: `clip.txt` or `clip.mp4.txt`.
The tables win over text files; where both tables name a file, captions.jsonl wins.
"""

import csv
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from slidefusion.data.video_io import read_video
from slidefusion.core.errors import UserError, check

VIDEO_SUFFIXES = (".mp4", ".gif", ".webm", ".avi")


def find_videos(root: Path) -> list[Path]:
    """Video files under `root`, sorted by relative path so indices are stable across machines."""
    found = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        # Hidden names include write_video's temporary files, which must never be read half-written.
        if path.suffix.lower() in VIDEO_SUFFIXES and path.is_file() and not _hidden(relative):
            found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _key(file: str) -> str:
    """Normalise a `file` entry so "./a.mp4", "a.mp4" and "sub\\a.mp4" match the files found."""
    return Path(file.strip().replace("\\", "/")).as_posix()


def _read_csv(path: Path) -> dict[str, str]:
    # utf-8-sig: spreadsheets often save CSV with a byte-order mark before the header.
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        columns = reader.fieldnames or []
        check("file" in columns and "caption" in columns,
              f"{path}: needs a header with columns file,caption; got {','.join(columns) or 'none'}")
        return {_key(row["file"] or ""): (row["caption"] or "").strip() for row in reader}


def _read_jsonl(path: Path) -> dict[str, str]:
    table = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                file, caption = _jsonl_entry(line, f"{path} line {number}")
                table[_key(file)] = caption.strip()
    return table


def _jsonl_entry(line: str, where: str) -> tuple[str, str]:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: invalid JSON ({err.msg})") from err
    ok = isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("file", "caption"))
    check(ok, f'{where}: expected {{"file": "<video>", "caption": "<text>"}}')
    return entry["file"], entry["caption"]


def caption_table(root: Path) -> dict[str, str]:
    """Captions from captions.csv and captions.jsonl under `root`, keyed by relative path."""
    table = {}
    if (root / "captions.csv").is_file():
        table.update(_read_csv(root / "captions.csv"))
    if (root / "captions.jsonl").is_file():
        table.update(_read_jsonl(root / "captions.jsonl"))
    return table


def _caption_for(video: Path, root: Path, table: dict[str, str]) -> str:
    relative = video.relative_to(root).as_posix()
    text = table.get(relative)
    for sidecar in (video.with_suffix(".txt"), video.with_name(video.name + ".txt")):
        if text is None and sidecar.is_file():
            text = sidecar.read_text(encoding="utf-8").strip()
    check(text is not None, f"no caption for video {video}: add it to captions.csv or captions.jsonl, "
                            f"or write {video.with_suffix('.txt')}")
    check(text != "", f"empty caption for video {video}")
    return text


def frame_indices(available: int, frames: int, stride: int) -> np.ndarray:
    """Indices of `frames` frames `stride` apart from the start; past the end, the last frame."""
    return np.minimum(np.arange(frames) * stride, available - 1)


def resize_center_crop(video: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Scale (T, C, h, w) so it covers height x width, keeping the aspect ratio, then crop the centre.

    Bilinear with antialiasing, so downscaling large footage does not alias.
    """
    h, w = video.shape[-2:]
    scale = max(height / h, width / w)
    size = (max(height, round(h * scale)), max(width, round(w * scale)))
    if size != (h, w):
        video = F.interpolate(video, size=size, mode="bilinear", align_corners=False, antialias=True)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    return video[..., top : top + height, left : left + width]


class VideoFolder(Dataset):
    """Clips from a folder of captioned videos.

    Item i is {"video": float32 (3, frames, height, width) in [-1, 1], "caption": str}: `frames`
    frames `stride` apart from the start of video i (the last frame repeats if the video is too
    short), resized to cover height x width and centre-cropped. Videos are decoded lazily, per item;
    captions are resolved up front so a missing one fails at construction.
    """

    def __init__(self, root: str | os.PathLike, frames: int, height: int, width: int, stride: int = 1):
        for name, value in (("frames", frames), ("height", height), ("width", width), ("stride", stride)):
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"{name} must be an int >= 1, got {value!r}")
        self.root = Path(root)
        check(self.root.is_dir(), f"root: no such folder: {self.root}")
        self.frames, self.height, self.width, self.stride = frames, height, width, stride
        self.files = find_videos(self.root)
        check(len(self.files) > 0, f"root: no videos ({', '.join(VIDEO_SUFFIXES)}) in {self.root}")
        table = caption_table(self.root)
        self.captions = [_caption_for(f, self.root, table) for f in self.files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        needed = (self.frames - 1) * self.stride + 1
        clip = read_video(self.files[i], frames=needed)  # (t, h, w, 3) uint8, t <= needed
        clip = clip[frame_indices(len(clip), self.frames, self.stride)]
        x = torch.from_numpy(clip).permute(0, 3, 1, 2).float()  # (T, 3, h, w) in [0, 255]
        x = resize_center_crop(x, self.height, self.width)  # (T, 3, H, W)
        video = x.permute(1, 0, 2, 3).div(127.5).sub(1.0).clamp(-1.0, 1.0)  # (3, T, H, W)
        return {"video": video.contiguous(), "caption": self.captions[i]}
