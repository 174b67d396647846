"""`Rows`: which samples of a step's batch this process computes, for data-parallel training.

A step draws its randomness (which clips, dropped captions, times, noise) for the whole global batch
from one generator, then each rank keeps its own rows. So the samples of rank r are a function of
(seed, step, r) alone, and a run on N ranks sees exactly the samples one process would see with N
times the batch.
"""

from dataclasses import dataclass

@dataclass(frozen=True)
class Rows:
    """Rows [start, start + count) of a global batch of `total` samples."""

    start: int
    count: int
    total: int

    def __post_init__(self):
        if not 0 <= self.start <= self.start + self.count <= self.total or self.count < 1:
            raise ValueError(f"rows [{self.start}, {self.start + self.count}) do not fit a batch of {self.total}")

    @classmethod
    def whole(cls, batch: int) -> "Rows":
        return cls(0, batch, batch)

    @property
    def share(self) -> float:
        """This process's fraction of the batch (1 / data-parallel ranks)."""
        return self.count / self.total

    def take(self, x):
        """This process's rows of `x` (a tensor or list along its first dimension)."""
        return x[self.start:self.start + self.count]


def local_rows(rows: Rows | None, batch: int) -> Rows:
    """`rows`, or the whole of a `batch` computed by one process."""
    return Rows.whole(batch) if rows is None else rows

