"""Rough colour measures for moving-shapes videos: where a colour is, and which colour dominates.

A video is (3, T, H, W) in [-1, 1]; a pixel counts for a palette colour when it lies within
`radius` of it in RGB (0-255). These are quick checks, not the evaluation issue's detector.
"""

import torch

from slidefusion.data.shapes import COLORS


def _rgb(video: torch.Tensor) -> torch.Tensor:
    return (video.permute(1, 2, 3, 0) + 1) * 127.5  # (T, H, W, 3) in [0, 255]


def centroid_track(video: torch.Tensor, rgb, radius: float = 90.0) -> torch.Tensor:
    """(T, 2) centre (y, x) in pixels of the pixels near colour `rgb`, frame by frame."""
    near = ((_rgb(video) - torch.tensor(rgb, dtype=torch.float32)).norm(dim=-1) < radius).float()  # (T, H, W)
    ys, xs = torch.meshgrid(torch.arange(video.shape[2]), torch.arange(video.shape[3]), indexing="ij")
    weight = near.sum(dim=(1, 2)).clamp(min=1)
    return torch.stack([(near * ys).sum(dim=(1, 2)) / weight, (near * xs).sum(dim=(1, 2)) / weight], dim=1)


def dominant_colour(video: torch.Tensor, radius: float = 90.0) -> str:
    """The palette colour (COLORS) nearest to the most pixels, among pixels near any of them."""
    pixels = _rgb(video).reshape(-1, 3)
    distance = torch.stack([(pixels - torch.tensor(rgb, dtype=torch.float32)).norm(dim=-1) for rgb in COLORS.values()])
    nearest = distance.argmin(dim=0)[distance.min(dim=0).values < radius]
    return list(COLORS)[torch.bincount(nearest, minlength=len(COLORS)).argmax()]
