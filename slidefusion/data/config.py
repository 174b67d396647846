"""The `data:` section of a run: where clips come from and their size in pixels (before the autoencoder)."""

from dataclasses import dataclass

from slidefusion.data.shapes import START_MODES
from slidefusion.errors import check


@dataclass
class DataConfig:
    """Where clips come from and their size in pixels (before the autoencoder)."""

    kind: str = "shapes"  # "shapes" (procedural, captioned) or "folder" (videos + captions file)
    frames: int = 8
    height: int = 32
    width: int = 32
    num_samples: int = 100_000  # distinct procedural clips; the folder's own size for "folder"
    seed: int = 0
    max_objects: int = 1
    start: str = "uniform"  # shapes: "uniform" (may bounce), "clear" (room ahead), "behind" (clear, near the back wall)
    root: str | None = None  # the video folder, for kind="folder"
    stride: int = 1  # frame stride when reading real videos
    fps: int = 8  # playback rate of exported videos
    cache_dir: str | None = None  # latent and text caches of a diffusers fine-tune (null: RUN/cache)

    def __post_init__(self):
        for name in ("frames", "height", "width", "num_samples", "max_objects", "stride", "fps"):
            value = getattr(self, name)
            check(value >= 1, f"data.{name}={value} must be >= 1")
        check(self.fps <= 1000, f"data.fps={self.fps} must be <= 1000 (the playback rate of exported videos)")
        check(self.kind in ("shapes", "folder"), f"data.kind={self.kind!r} is unknown; valid: shapes, folder")
        check(self.start in START_MODES, f"data.start={self.start!r} is unknown; valid: {', '.join(START_MODES)}")
        check(self.kind != "folder" or self.root, "data.root must name the video folder when data.kind=folder")
