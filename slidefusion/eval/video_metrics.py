"""Offline, model-free quality measures of generated videos: flicker, motion smoothness, warping error.

A video is uint8 numpy (T, H, W, 3) RGB or a float tensor/array (3, T, H, W) in [-1, 1]; both are
read through `to_uint8`, so the two forms of one video give identical numbers. Motion comes from
OpenCV's dense Farneback optical flow on grayscale frames, so nothing here needs a learned model or
a download; the numbers are meant for comparing videos of one size with each other, not with
published benchmark tables.

Flow convention (OpenCV's): a flow field is float32 (H, W, 2) holding (dx, dy) in pixels, and the
flow from frame a to frame b says where each pixel of a went in b: a(p) ~ b(p + flow(p)).
"""

import numpy as np

from slidefusion.data.video_io import to_uint8
from slidefusion.core.errors import check

# Farneback parameters, chosen for our tiny frames (32x32 to 64x64). OpenCV only builds a pyramid
# level while it stays >= 32 px per side, so LEVELS is a cap: a 32x32 frame gets one level and a
# 64x64 frame two. A 9x9 window is wide enough to follow ~3 px of motion on one level, yet small
# enough that two nearby shapes moving apart keep separate flows. Tested on moving-shapes scenes and
# a textured disc: upscaling frames 2x or 4x before the flow (and scaling the flow back) was no more
# accurate and ~5x slower, so frames are used at their own size.
FLOW_PYR_SCALE = 0.5  # each pyramid level halves the frame
FLOW_LEVELS = 3  # at most this many levels (see above)
FLOW_WINSIZE = 9  # averaging window, pixels
FLOW_ITERATIONS = 3  # refinements per pyramid level
FLOW_POLY_N = 5  # neighbourhood of the per-pixel polynomial fit, pixels
FLOW_POLY_SIGMA = 1.1  # Gaussian weighting of that fit; OpenCV recommends 1.1 for poly_n=5

# Forward-backward consistency test of Sundaram, Brox and Keutzer (ECCV 2010): a pixel p of frame t
# keeps its flow w = f_fw(p) when the backward flow at its target, v = f_bw(p + w), brings it back:
#     |w + v|^2 < CONSISTENCY_RELATIVE * (|w|^2 + |v|^2) + CONSISTENCY_ABSOLUTE   (pixels^2)
CONSISTENCY_RELATIVE = 0.01
CONSISTENCY_ABSOLUTE = 0.5


def _frames(video, min_frames: int = 2) -> np.ndarray:
    """`video` as contiguous uint8 (T, H, W, 3), with at least `min_frames` frames."""
    frames = to_uint8(video)  # raises UserError naming `video` for a wrong type, rank or channels
    check(frames.shape[0] >= min_frames,
          f"video must have at least {min_frames} frames, got {frames.shape[0]}")
    return frames


def _cv2():
    """OpenCV, imported on first use: it comes with the optional `eval` extra, and the command line
    imports this module to register `slidefusion evaluate` whether or not it is installed."""
    import cv2

    return cv2


def _gray(frame, name: str) -> np.ndarray:
    """A uint8 frame, (H, W) grayscale or (H, W, 3) RGB, as uint8 (H, W) grayscale."""
    ok = isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and frame.size > 0 and (
        frame.ndim == 2 or (frame.ndim == 3 and frame.shape[-1] == 3))
    check(ok, f"{name} must be a non-empty uint8 array (H, W) or (H, W, 3), got "
              f"{getattr(frame, 'dtype', type(frame).__name__)} {getattr(frame, 'shape', '')}")
    cv2 = _cv2()
    return cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY) if frame.ndim == 3 else np.ascontiguousarray(frame)


def optical_flow(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Dense optical flow from frame `a` to frame `b`, float32 (H, W, 2) as (dx, dy) in pixels.

    `a` and `b` are uint8, (H, W) grayscale or (H, W, 3) RGB (converted with ITU-R BT.601 weights).
    Farneback's method with the FLOW_* parameters above; a(p) ~ b(p + flow(p)). Identical frames
    get exactly zero flow: Farneback's estimate is not exactly zero on them, and a static video
    should measure as perfectly still.
    """
    a, b = _gray(a, "a"), _gray(b, "b")
    check(a.shape == b.shape, f"a and b must have the same height and width, got {a.shape} and {b.shape}")
    if np.array_equal(a, b):
        return np.zeros((*a.shape, 2), dtype=np.float32)
    return _cv2().calcOpticalFlowFarneback(
        a, b, None, FLOW_PYR_SCALE, FLOW_LEVELS, FLOW_WINSIZE, FLOW_ITERATIONS, FLOW_POLY_N,
        FLOW_POLY_SIGMA, 0,
    )


def warp(frame: np.ndarray, flow: np.ndarray) -> np.ndarray:
    """Backward warp: output(p) = frame(p + flow(p)), bilinear, borders replicated.

    `frame` is (H, W) or (H, W, C) with C <= 4 (uint8 or float32; the output keeps the dtype),
    `flow` is (H, W, 2) as (dx, dy) in pixels. With flow = optical_flow(a, b), warp(b, flow) ~ a.
    """
    check(isinstance(frame, np.ndarray) and frame.ndim in (2, 3),
          f"frame must be a numpy array (H, W) or (H, W, C), "
          f"got {getattr(frame, 'shape', type(frame).__name__)}")
    check(isinstance(flow, np.ndarray) and flow.shape == (*frame.shape[:2], 2),
          f"flow must be a numpy array (H, W, 2) matching frame {frame.shape[:2]}, "
          f"got {getattr(flow, 'shape', type(flow).__name__)}")
    height, width = flow.shape[:2]
    xs, ys = np.meshgrid(np.arange(width, dtype=np.float32), np.arange(height, dtype=np.float32))
    map_x, map_y = xs + flow[..., 0].astype(np.float32), ys + flow[..., 1].astype(np.float32)
    cv2 = _cv2()
    return cv2.remap(frame, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)


def _consistent(forward: np.ndarray, backward: np.ndarray) -> np.ndarray:
    """(H, W) bool: pixels whose forward flow passes the forward-backward test (see CONSISTENCY_*)."""
    back = warp(backward, forward)  # backward flow sampled where each pixel lands: f_bw(p + f_fw(p))
    mismatch = np.square(forward + back).sum(axis=-1)
    scale = np.square(forward).sum(axis=-1) + np.square(back).sum(axis=-1)
    return mismatch < CONSISTENCY_RELATIVE * scale + CONSISTENCY_ABSOLUTE


def temporal_flickering(video) -> float:
    """VBench's temporal flickering score; higher is steadier, 1.0 for a static video.

    For each pair of consecutive frames, mae_t = mean |frame_t - frame_{t+1}| over all pixels and
    channels in 0..255; score = (255 - mean_t mae_t) / 255. VBench computes it the same way
    (cv2.absdiff and np.mean per uint8 frame pair), though on real videos it keeps static clips only.
    """
    frames = _frames(video).astype(np.int16)
    mae = np.abs(np.diff(frames, axis=0)).mean(axis=(1, 2, 3))  # (T - 1,)
    return float((255.0 - mae.mean()) / 255.0)


def warping_error(video) -> float:
    """Mean flow warping error in [0, 1]; lower is better, 0.0 for a static video.

    For each pair of consecutive frames: f_fw = optical_flow(frame_t, frame_{t+1}),
    f_bw = optical_flow(frame_{t+1}, frame_t), and M the pixels passing the forward-backward test
    (see CONSISTENCY_*), which leaves out occlusions and unreliable flow. The pair's error is
    mean over p in M and the 3 channels of |frame_t(p) - warp(frame_{t+1}, f_fw)(p)| / 255, or the
    same mean over all pixels when M is empty. The result is the mean over pairs.
    """
    frames = _frames(video)
    grays = [_gray(f, "video") for f in frames]
    errors = []
    for t in range(len(frames) - 1):
        forward = optical_flow(grays[t], grays[t + 1])
        backward = optical_flow(grays[t + 1], grays[t])
        mask = _consistent(forward, backward)
        diff = np.abs(warp(frames[t + 1], forward).astype(np.float64) - frames[t]).mean(axis=-1)  # (H, W)
        errors.append(diff[mask].mean() if mask.any() else diff.mean())
    return float(np.mean(errors) / 255.0)


def _middle_frame(prev: np.ndarray, next_: np.ndarray, gray_prev: np.ndarray, gray_next: np.ndarray):
    """The frame halfway between uint8 frames `prev` and `next_`, by flow, as uint8 (H, W, 3).

    D = (f_{next->prev} - f_{prev->next}) / 2 estimates, at each pixel, the displacement from next_
    to prev (averaging the two flows is more robust than either alone). Each frame is warped half
    way towards the middle and the two are averaged:
        middle = (warp(prev, D / 2) + warp(next_, -D / 2)) / 2, rounded to uint8.
    """
    displacement = 0.5 * (optical_flow(gray_next, gray_prev) - optical_flow(gray_prev, gray_next))
    from_prev = warp(prev.astype(np.float32), 0.5 * displacement)
    from_next = warp(next_.astype(np.float32), -0.5 * displacement)
    return np.clip(np.rint(0.5 * (from_prev + from_next)), 0, 255).astype(np.uint8)


def motion_smoothness(video) -> float:
    """How well each odd frame is predicted from its neighbours by flow; higher is smoother.

    VBench's idea with classical flow instead of its learned interpolator (AMT): drop every odd
    frame t (1, 3, 5, ... while t + 1 exists), rebuild it from frames t - 1 and t + 1 by
    flow-based interpolation (see `_middle_frame`), and score
        mean over dropped t of (255 - mean |rebuilt_t - frame_t|) / 255,
    the mean running over all pixels and channels in 0..255. This is our offline substitute, so its
    values are not comparable with VBench's published motion smoothness numbers. A static video
    scores 1.0. Needs at least 3 frames.
    """
    frames = _frames(video, min_frames=3)
    grays = [_gray(f, "video") for f in frames]
    scores = []
    for t in range(1, len(frames) - 1, 2):
        rebuilt = _middle_frame(frames[t - 1], frames[t + 1], grays[t - 1], grays[t + 1])
        mae = np.abs(rebuilt.astype(np.int16) - frames[t]).mean()
        scores.append((255.0 - mae) / 255.0)
    return float(np.mean(scores))


def video_metrics(video) -> dict[str, float]:
    """All three measures of one video (at least 3 frames): temporal_flickering (higher is better),
    motion_smoothness (higher is better) and warping_error (lower is better)."""
    frames = _frames(video, min_frames=3)  # convert once; the measures accept uint8 as is
    return {
        "temporal_flickering": temporal_flickering(frames),
        "motion_smoothness": motion_smoothness(frames),
        "warping_error": warping_error(frames),
    }
