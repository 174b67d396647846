"""The `data:` section of a run: where clips come from and their size in pixels (before the
autoencoder), and `SourceConfig`, one entry of `data.datasets` (see `slidefusion.data.sources`)."""

from dataclasses import dataclass

from slidefusion.core.errors import check, choose
from slidefusion.data.frames import MODES
from slidefusion.data.media import MEDIA_SUFFIXES
from slidefusion.data.shapes import START_MODES


@dataclass
class SourceConfig:
    """One folder of a dataset (`data.datasets` entries); see `slidefusion.data.sources`."""

    root: str
    repeats: int = 1
    caption_extension: str = ".txt"
    frames: str = "head"  # head | chunk | slide (+ stride) | uniform (+ count)
    stride: int = 1  # frames=slide: timeline frames between the starts of two clips
    count: int = 1  # frames=uniform: clips per file
    fps: float | None = None  # resample to this rate; null: the file's own frames
    frame_step: int = 1  # without fps: every frame_step-th frame (data.stride of the single-folder keys)
    resolution: list[int] | None = None  # [width, height]: one fixed size for this source

    def check(self, key: str) -> None:
        """A UserError naming `key` (e.g. data.datasets[1]) for a value no scan could use."""
        check(isinstance(self.root, str) and self.root.strip() != "", f"{key}.root must name a folder")
        check(self.repeats >= 1, f"{key}.repeats={self.repeats} must be >= 1")
        ext = self.caption_extension
        check(isinstance(ext, str) and ext.startswith(".") and len(ext) > 1 and "/" not in ext,
              f"{key}.caption_extension={ext!r} must look like .txt")
        check(ext.lower() not in MEDIA_SUFFIXES, f"{key}.caption_extension={ext!r} is a media type")
        choose(self.frames, MODES, f"{key}.frames")
        check(isinstance(self.stride, int) and self.stride >= 1, f"{key}.stride={self.stride!r} must be an int >= 1 "
                                                                 "(frames between the starts of two clips with frames=slide)")
        check(isinstance(self.count, int) and self.count >= 1, f"{key}.count={self.count!r} must be an int >= 1 "
                                                               "(clips per file with frames=uniform)")
        check(self.fps is None or 0 < self.fps <= 1000, f"{key}.fps={self.fps} must be in (0, 1000] or null")
        check(self.frame_step >= 1, f"{key}.frame_step={self.frame_step} must be >= 1")
        check(self.fps is None or self.frame_step == 1, f"{key}: fps and frame_step exclude each other")
        if self.resolution is not None:
            check(len(self.resolution) == 2 and all(s >= 1 for s in self.resolution),
                  f"{key}.resolution={self.resolution} must be [width, height]")


@dataclass
class DataConfig:
    """Where clips come from and their size in pixels (before the autoencoder).

    Real files: `root` (one folder, the keys below it) or `datasets` (a list of sources, see
    `slidefusion.data.sources`). Sizes: one fixed `frames` x `height` x `width`, or buckets:
    `resolution` (a target area: R or [width, height]) and `frame_buckets` (clip lengths)."""

    kind: str = "shapes"  # "shapes" (procedural, captioned) or "folder" (videos, images + captions)
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
    datasets: list[SourceConfig] | None = None  # several sources with their own settings (instead of root)
    resolution: int | list[int] | None = None  # aspect buckets of this area (null: frames x height x width)
    frame_buckets: list[int] | None = None  # clip lengths; each clip takes the largest it fills (null: [frames])
    strict: bool = False  # any skipped file is an error

    def __post_init__(self):
        for name in ("frames", "height", "width", "num_samples", "max_objects", "stride", "fps"):
            value = getattr(self, name)
            check(value >= 1, f"data.{name}={value} must be >= 1")
        check(self.fps <= 1000, f"data.fps={self.fps} must be <= 1000 (the playback rate of exported videos)")
        check(self.kind in ("shapes", "folder"), f"data.kind={self.kind!r} is unknown; valid: shapes, folder")
        check(self.start in START_MODES, f"data.start={self.start!r} is unknown; valid: {', '.join(START_MODES)}")
        check(self.kind != "folder" or self.root or self.datasets is not None,
              "data.root must name the video folder when data.kind=folder (or list sources in data.datasets)")
        self._check_sources()
        if self.resolution is not None:
            sides = [self.resolution] if isinstance(self.resolution, int) else self.resolution
            check(len(sides) in (1, 2) and all(1 <= side <= 65536 for side in sides),
                  f"data.resolution={self.resolution!r} must be a side R (R x R pixels) or [width, height]")
        if self.frame_buckets is not None:
            check(len(self.frame_buckets) > 0 and all(f >= 1 for f in self.frame_buckets),
                  f"data.frame_buckets={self.frame_buckets} must list clip lengths >= 1, e.g. [1, 17, 33]")

    def _check_sources(self) -> None:
        check(self.kind == "folder" or self.datasets is None,
              f"data.datasets lists real files (data.kind=folder), not data.kind={self.kind}")
        check(self.datasets is None or self.root is None,
              f"data.root={self.root!r} and data.datasets exclude each other; set data.root=null to use data.datasets")
        if self.datasets is not None:
            check(len(self.datasets) > 0, "data.datasets=[] is empty; list at least one source, e.g. [{root: clips}]")
            for index, source in enumerate(self.datasets):
                source.check(f"data.datasets[{index}]")

    def ignored_buckets(self) -> str | None:
        """A note when bucket keys are set for the procedural shapes, which render one size."""
        keys = [f"data.{k}" for k in ("resolution", "frame_buckets") if getattr(self, k) is not None]
        if self.kind != "shapes" or not keys:
            return None
        return (f"note: {' and '.join(keys)} apply to real files (data.kind=folder); data.kind=shapes renders "
                f"{self.frames}x{self.height}x{self.width} clips")

    def sources(self) -> list[tuple[SourceConfig, str]]:
        """(source, the config key its errors name) of real files: `datasets`, or `root` as one source."""
        if self.datasets is not None:
            return [(source, f"data.datasets[{i}]") for i, source in enumerate(self.datasets)]
        return [(SourceConfig(root=self.root, frame_step=self.stride), "data")]
