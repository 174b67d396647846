"""Buckets: clips of different shapes trained without padding, each batch of one shape.

Aspect buckets: `data.resolution` is a target area in pixels (an int R: R x R; [W, H]: W x H). For
each width in steps of the VAE's spatial factor times the patch (16 for Wan), the tallest height
(same steps) whose area stays within the target makes one bucket, if its aspect ratio is within
MAX_RATIO. A clip goes to the bucket nearest its aspect ratio (in log space) and is resized to cover
it, then cropped at the centre: the least cropping that bucket allows.

Frame buckets: `data.frame_buckets` are clip lengths the VAE accepts (Wan: 1 + 4k); a clip goes to
the largest one it can fill, so clips are never padded.

`BucketBatches` deals the clips into batches per epoch: each bucket's clips (repeated as their
source says) shuffled, cut into batches of one bucket (the last one may be smaller, so no clip is
dropped), and the batches shuffled, all from a generator seeded by (run seed, epoch). Batch k of
the run is a function of k alone, so a resumed run draws exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from slidefusion.core.errors import UserError, check

MAX_RATIO = 4.0  # the most elongated bucket (4:1 either way): a 1:8 panorama is cropped to 1:4


@dataclass(frozen=True, order=True)
class Bucket:
    """A clip shape in pixels."""

    frames: int
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.frames}x{self.height}x{self.width}"


def target_area(resolution, step: int, key: str) -> int:
    """The area in pixels of `data.resolution` (int R or [W, H]), each side a multiple of `step`."""
    sides = [resolution] if isinstance(resolution, int) else list(resolution)
    check(len(sides) in (1, 2) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sides),
          f"{key}={resolution!r} must be a side R (R x R pixels) or [width, height]")
    bad = [s for s in sides if s % step]
    if bad:
        raise UserError(f"{key}={resolution!r}: {bad[0]} is not divisible by {step} (the VAE's spatial factor x "
                        f"the patch); e.g. {max(step, bad[0] // step * step)}")
    return sides[0] * sides[-1]


def aspect_buckets(area: int, step: int, max_ratio: float = MAX_RATIO) -> list[tuple[int, int]]:
    """(height, width) buckets of at most `area` pixels, sides multiples of `step`, by aspect ratio."""
    found = set()
    for width in range(step, area // step + 1, step):
        height = area // width // step * step
        if height >= step and max(height / width, width / height) <= max_ratio:
            found.add((height, width))
    check(found, f"no bucket of at most {area} pixels has sides that are multiples of {step}")
    return sorted(found, key=lambda hw: hw[0] / hw[1])


def nearest_bucket(height: int, width: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket nearest the aspect ratio of a `height` x `width` clip (the larger on a tie)."""
    ratio = math.log(height / width)
    return min(buckets, key=lambda hw: (abs(math.log(hw[0] / hw[1]) - ratio), -hw[0] * hw[1]))


def pixels_kept(height: int, width: int, bucket_height: int, bucket_width: int) -> float:
    """The share of a clip's picture a resize-to-cover and centre crop into the bucket keeps."""
    scale = max(bucket_height / height, bucket_width / width)
    return (bucket_height * bucket_width) / (height * scale * width * scale)


def check_frame_buckets(buckets: list[int], temporal: int, key: str = "data.frame_buckets") -> list[int]:
    """`buckets` sorted, each a length the VAE accepts (1 + temporal * k), or a UserError."""
    check(len(buckets) > 0, f"{key}=[] must list at least one clip length, e.g. [1, 17, 33]")
    for frames in buckets:
        check(isinstance(frames, int) and frames >= 1 and (frames - 1) % temporal == 0,
              f"{key}: {frames} is not allowed by this VAE; valid: 1 + {temporal}k "
              f"(e.g. 1, {1 + temporal}, {1 + 4 * temporal})")
    return sorted(set(buckets))


def frame_bucket(available: int, buckets: list[int]) -> int | None:
    """The largest bucket a clip of `available` frames fills, or None."""
    fitting = [b for b in buckets if b <= available]
    return max(fitting) if fitting else None


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The epoch's shuffle stream: a function of (seed, epoch) only, apart from the step streams."""
    digest = hashlib.sha256(f"buckets:{seed}:{epoch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class BucketBatches:
    """Batches of sample indices, each batch from one bucket (see the module docstring).

    `buckets[i]` is sample i's bucket, `repeats[i]` how often it appears per epoch."""

    def __init__(self, buckets: list[Bucket], repeats: list[int], batch_size: int, seed: int, whole: int = 1):
        """`whole` > 1 (data-parallel ranks x their batch): a bucket's last, short batch is completed
        to a multiple of `whole` with samples of the same bucket from the start of its order, as
        torch's DistributedSampler completes its last batch, so that no rank is left without rows."""
        check(len(buckets) == len(repeats) and len(buckets) > 0, "no samples to deal into batches")
        self.groups: dict[Bucket, list[int]] = {}
        for index, (bucket, times) in enumerate(zip(buckets, repeats)):
            self.groups.setdefault(bucket, []).extend([index] * times)
        self.groups = dict(sorted(self.groups.items()))
        self.batch_size, self.seed, self.whole = batch_size, seed, whole
        self.per_epoch = sum(math.ceil(len(g) / batch_size) for g in self.groups.values())
        self._epoch: tuple[int, list[list[int]]] | None = None

    def epoch(self, epoch: int) -> list[list[int]]:
        """Every batch of `epoch`, in the order they are trained."""
        if self._epoch is None or self._epoch[0] != epoch:
            generator = epoch_generator(self.seed, epoch)
            batches = []
            for samples in self.groups.values():
                order = [samples[i] for i in torch.randperm(len(samples), generator=generator).tolist()]
                batches += [self._complete(order[k:k + self.batch_size], order)
                            for k in range(0, len(order), self.batch_size)]
            self._epoch = (epoch, [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()])
        return self._epoch[1]

    def _complete(self, batch: list[int], order: list[int]) -> list[int]:
        short = -len(batch) % self.whole
        return batch + [order[i % len(order)] for i in range(short)]

    def batch(self, number: int) -> list[int]:
        """Batch `number` of the run (0-based, counting across epochs)."""
        if number < 0:
            raise UserError(f"batch {number} does not exist")
        epoch, position = divmod(number, self.per_epoch)
        return self.epoch(epoch)[position]

    def table(self) -> list[tuple[Bucket, int, int]]:
        """(bucket, samples per epoch, batches per epoch) of every bucket."""
        return [(b, len(g), math.ceil(len(g) / self.batch_size)) for b, g in self.groups.items()]


def format_bucket_table(batches: BucketBatches, grad_accum: int = 1) -> str:
    """The bucket table printed before step 1."""
    rows = [("bucket (frames x height x width)", "clips/epoch", "batches/epoch")]
    rows += [(str(b), str(n), str(k)) for b, n, k in batches.table()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    per_step = f"{batches.batch_size} clips" + (f" in {grad_accum} micro-batches" if grad_accum > 1 else "")
    lines.append(f"{batches.per_epoch} steps per epoch, each a batch of up to {per_step} from one bucket")
    return "\n".join(lines)
