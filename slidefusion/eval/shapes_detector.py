"""A detector for moving-shapes videos: does a (generated) video show what its prompt asks for?

`detect(video, color)` finds the object of one palette colour in every frame and measures it;
`score(video, prompt)` checks each object of a prompt (the `slidefusion.data.shapes` caption
grammar) against the video; `summarize` turns many scores into rates. Plain numpy; a 32x32 clip
costs about 1-2 ms of CPU per frame.

Units and conventions are those of `slidefusion.data.shapes`: RGB in 0..255, positions in pixels
with pixel centres at (i + 0.5), (y, x) order, y growing downwards, radius as in `radius_px`
(circumradius; half the side for a square). Steps, with the constants below in CAPITALS:

1. Background. Objects cover a small part of a frame, so the background of frame t is the
   per-channel median of its pixels; per frame, to tolerate flicker and off-palette tints.

2. Colour labels (alpha matting against the background, in RGB). The renderer blends an object over
   the background linearly in RGB, pixel = bg + alpha (colour - bg); antialiasing, blur and codecs
   mix linearly too. So for each palette colour k a pixel is explained by the nearest point of the
   segment bg -> COLORS[k]: alpha_k the clipped projection, residual_k the RGB distance to that
   point. A pixel gets the label of least residual if that residual <= RESIDUAL_MAX and its alpha
   >= ALPHA_MIN, else it is background. Edge pixels, half object and half background, keep their
   true label this way, where a plain nearest-colour rule would call them background or another
   colour. (Blends are straight lines in RGB and its linear transforms such as YCbCr, not in a
   perceptual space such as Lab, so one would not help here.)

3. Soft mask (coverage) of colour c. The object's actual colour is the median of the video's
   interior pixels of label c (palette alpha >= INTERIOR_ALPHA), so an object a little off its
   palette colour still reaches coverage ~1. Coverage is the projection onto bg -> actual colour
   under an inner product that weights chroma by CHROMA_WEIGHT against luma (BT.601 YCbCr): codecs
   (yuv420p) and resizing keep luma sharper than chroma; for exact blends any weighting gives the
   same coverage. It is kept at pixels labelled c and at background-labelled pixels next to them
   (8-neighbourhood: edges a codec pushed off the colour); it is 0 elsewhere.

4. Localisation, per frame. The soft mask summed over a box of about the smallest object's size
   peaks on the object; a square window of half-size ceil(1.5 x the largest radius of SIZE_RANGE)
   + 1 is centred there and re-centred twice on the coverage centroid. Stray pixels of the colour
   outside the window are ignored. In the window: area = sum of coverage (pixels^2), centroid =
   coverage-weighted mean. The object is present when area >= MIN_AREA_FRACTION x the area of the
   smallest triangle the generator draws (~2.6 px^2 at 32x32).

5. Shape, per present frame, by analysis-by-synthesis with the renderer itself (`shapes._coverage`).
   For each shape the radius giving the measured area is solved in closed form (area per r^2:
   circle pi, square 4, diamond 2, triangle 3 sqrt(3) / 4), then radius (x RADIUS_SCALES), centre
   (centroid + CENTRE_OFFSETS on each axis) and blur (Gaussian of BLUR_SIGMAS px, for soft
   generated blobs) are searched on a grid. The frame's shape is the one whose best synthetic
   coverage has the least squared error to the window's soft mask (divided by the area). A frame
   is `occluded` when other palette colours' labelled alpha within its fitted radius + 1 px of the
   centroid exceeds OCCLUSION_FRACTION x its area (another object overlaps or touches it). The
   track's shape is the majority over present frames that are not occluded (all present frames if
   every one is; ties: least summed error), its radius the median radius of the frames that voted
   for it.

6. Motion. For each of the 8 directions x 2 speeds, the model is the closed form of
   `shapes.object_centers`: per axis start + d * speed * t, folded by `shapes._reflect` into
   [r, side - r]. Start and r are fitted to minimise the mean squared centroid error over the
   present frames that are not occluded (all present frames when fewer than MIN_MOTION_FRAMES or
   than half of them are clear): r over the track radius x MOTION_RADIUS_SCALES, the start on a
   grid over [r, side - r] (4 x MOTION_STEP px, then MOTION_STEP px around the best), separately
   per axis since the squared error splits over axes. Starts stay inside the walls: the object
   moves in the named direction at frame 0, as the generator draws it, so a reversed clip reads as
   the opposite direction. The best candidate gives direction and speed; `motion_residual` is its
   RMS error in pixels. Direction and speed are None ("no consistent motion") when the object is
   present in fewer than half the frames or fewer than MIN_MOTION_FRAMES, or the residual exceeds
   `motion_tolerance` = max(1 px, MOTION_TOLERANCE x the shorter side), 1.92 px at 32x32.
   `heading` is the lenient reading: the direction of the best candidate whatever its residual
   (None only when nothing could be fitted), for blurry generated objects that drift the right
   way without following a clean trajectory; chance is 1/8.

7. Consistency (subject consistency) of a track, in [0, 1], is the mean of four stabilities:
   presence  the fraction of frames in which the object is present;
   size      1 - min(1, coefficient of variation (std / mean) of the area over present frames);
   shape     the fraction of present frames whose shape is the track's shape;
   colour    1 - min(1, s / PALETTE_GAP): s = sqrt of the summed per-channel variance, over present
             frames, of the object's mean colour (coverage-weighted over pixels of coverage >= 0.5,
             each un-mixed from the background as bg + (pixel - bg) / coverage); PALETTE_GAP = the
             least RGB distance between two palette colours (88, yellow to orange).
   With no present frame all four are 0. The order of frames does not matter to it: shuffled
   frames are caught by the motion fit instead. Ground truth scores ~0.998.

8. Scoring a prompt (`score`). Each object of the prompt is detected by its colour:
   color_ok      present in >= half the frames, and its colour dominates near it: over present
                 frames, within the frame's fitted radius + 1 px of the centroid, the labelled
                 alpha of the prompt's colour exceeds that of every other palette colour, leaving
                 out the colours of the prompt's other objects (they may overlap it);
   shape_ok      detected shape == prompt's; direction_ok and speed_ok likewise; speed_ok is None
                 when the prompt leaves the speed out;
   aligned       color_ok and shape_ok and direction_ok (speed is reported, not required).
   heading_ok    the track's heading is the prompt's direction (lenient; not part of aligned).
   A clip's checks are the conjunction over its objects; its consistency is the mean over them.
   The clip's background is the BACKGROUNDS colour nearest the median of step 1 (background_ok
   when the prompt names one; reported, not part of aligned).

Limits: one object per colour (as the generator draws). An object hidden behind another for most
frames is absent; a partly hidden one measures a smaller, shifted area in those frames, which the
occlusion rule keeps out of its shape and motion only while enough frames are clear.
"""

import math
from dataclasses import dataclass, field

import numpy as np

from slidefusion.data.shapes import (
    BACKGROUNDS,
    COLORS,
    DIRECTIONS,
    SHAPES,
    SIZE_RANGE,
    SPEEDS,
    _coverage,
    _reflect,
    parse_caption,
)
from slidefusion.data.video_io import to_uint8
from slidefusion.core.errors import check, choose

RESIDUAL_MAX = 70.0  # RGB distance off the bg -> colour segment still counted as that colour
ALPHA_MIN = 0.15  # weaker blends are background (codec ringing, noise)
INTERIOR_ALPHA = 0.6  # palette alpha of the pixels that estimate an object's actual colour
MIN_AREA_FRACTION = 0.3  # present when area >= this x the area of the smallest triangle
RADIUS_SCALES = np.array([0.85, 0.925, 1.0, 1.075, 1.15])
BLUR_SIGMAS = (0.0, 0.7, 1.2)  # pixels: templates sharp and blurred, for soft generated blobs
CENTRE_OFFSETS = np.array([-0.25, 0.0, 0.25])  # pixels, on each axis
MOTION_RADIUS_SCALES = np.array([0.8, 0.9, 1.0, 1.1, 1.2])
MOTION_STEP = 0.05  # pixels between start positions tried
MOTION_TOLERANCE = 0.06  # residual limit as a fraction of the shorter side (and at least 1 px)
MIN_MOTION_FRAMES = 3
OCCLUSION_FRACTION = 0.1  # other colours' alpha near the object, as a fraction of its area

# BT.601 RGB -> (Y, Cb, Cr). Coverage is measured with chroma down-weighted: codecs (yuv420p) and
# resizing keep luma sharper than chroma; for exact blends any weighting gives the same alpha.
_YCBCR = np.array([[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]])
CHROMA_WEIGHT = 0.1
_COVERAGE_METRIC = _YCBCR.T @ np.diag([1.0, CHROMA_WEIGHT, CHROMA_WEIGHT]) @ _YCBCR
_PALETTE = np.array(list(COLORS.values()), dtype=np.float64)  # (K, 3)
PALETTE_GAP = min(
    float(np.linalg.norm(a - b)) for i, a in enumerate(_PALETTE) for b in _PALETTE[i + 1:]
)
# Area of each shape per squared circumradius (for the triangle: equilateral, 3 sqrt(3) / 4).
_AREA_PER_R2 = {"circle": math.pi, "square": 4.0, "diamond": 2.0, "triangle": 3 * math.sqrt(3) / 4}
_MOTIONS = [(d, s) for d in DIRECTIONS for s in SPEEDS]


@dataclass(frozen=True)
class Track:
    """What `detect` measured for one colour in a video of T frames.

    Per frame (length T; NaN / None where the object is absent): `present`, `area` (coverage in
    pixels^2, also where below the presence threshold), `centroid` (T, 2) as (y, x), `radius`
    (fitted circumradius), `occluded` (another colour overlaps or touches it), `frame_shapes`,
    `mean_colour` (T, 3) un-mixed interior RGB.
    Per track: `shape`, `radius_px`, `direction`, `speed` (None when undetermined), `start` (y, x)
    and `path` (T, 2) of the fitted motion (None when not fitted), `motion_residual` (RMS pixels;
    inf when not fitted), `motion_errors` (RMS per (direction, speed) candidate),
    `region_colours` (palette colour -> alpha labelled with it within the fitted radius + 1 px of
    the centroid, summed over present frames), `consistency` and its `consistency_parts`.
    """

    color: str
    present: np.ndarray
    area: np.ndarray
    centroid: np.ndarray
    radius: np.ndarray
    occluded: np.ndarray
    frame_shapes: tuple
    mean_colour: np.ndarray
    shape: str | None
    radius_px: float
    direction: str | None
    speed: str | None
    start: tuple[float, float] | None
    path: np.ndarray | None
    motion_residual: float
    motion_errors: dict = field(repr=False)
    region_colours: dict
    consistency: float
    consistency_parts: dict

    @property
    def present_fraction(self) -> float:
        return float(self.present.mean())

    @property
    def heading(self) -> str | None:
        """The direction whose bounced trajectory (at either speed) fits the centroids best, however
        poor the fit: a lenient reading of motion for blurry generated objects (chance is 1/8).
        None only when too few frames were present to fit at all."""
        if not self.motion_errors:
            return None
        return min(self.motion_errors, key=self.motion_errors.get)[0]

    def dominant_color(self, ignore=()) -> str | None:
        """The colour with the most coverage near the object, leaving out the colours in `ignore`
        (other than the track's own: in `score`, those of the prompt's other objects)."""
        shares = {c: v for c, v in self.region_colours.items() if c == self.color or c not in ignore}
        return max(shares, key=shares.get) if shares else None

    def color_share(self, ignore=()) -> float:
        """The fraction of that coverage with the track's own colour (same `ignore`)."""
        shares = {c: v for c, v in self.region_colours.items() if c == self.color or c not in ignore}
        total = sum(shares.values())
        return shares.get(self.color, 0.0) / total if total > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# Segmentation


@dataclass(frozen=True)
class Segmentation:
    """Per-pixel colour labels of a video: `label` (T, H, W) index into COLORS or -1 (background),
    `alpha` (T, H, W) coverage along bg -> palette colour of that label, `background` (T, 3)."""

    frames: np.ndarray  # float64 (T, H, W, 3)
    background: np.ndarray
    label: np.ndarray
    alpha: np.ndarray


def segment(video) -> Segmentation:
    """Label every pixel with its palette colour or background (module docstring, steps 1-2)."""
    frames = to_uint8(video).astype(np.float64)
    t = frames.shape[0]
    background = np.median(frames.reshape(t, -1, 3), axis=1)  # (T, 3)
    offset = frames - background[:, None, None, :]  # (T, H, W, 3)
    axes = _PALETTE[None, :, :] - background[:, None, :]  # (T, K, 3)
    norm2 = np.maximum((axes**2).sum(-1), 1.0)  # (T, K)
    along = np.einsum("thwc,tkc->thwk", offset, axes)  # (T, H, W, K): offset . axis
    alpha = np.clip(along / norm2[:, None, None, :], 0.0, 1.0)
    # Squared distance to the nearest point bg + alpha * axis, without a (T, H, W, K, 3) array.
    miss2 = (offset**2).sum(-1)[..., None] - 2 * alpha * along + alpha**2 * norm2[:, None, None, :]
    residual = np.sqrt(np.maximum(miss2, 0.0))
    best = residual.argmin(-1)
    best_alpha = np.take_along_axis(alpha, best[..., None], -1)[..., 0]
    best_residual = np.take_along_axis(residual, best[..., None], -1)[..., 0]
    valid = (best_alpha >= ALPHA_MIN) & (best_residual <= RESIDUAL_MAX)
    label = np.where(valid, best, -1)
    return Segmentation(frames, background, label, np.where(valid, best_alpha, 0.0))


def _dilate(mask: np.ndarray) -> np.ndarray:
    """(T, H, W) bool mask grown by one pixel (8-neighbourhood) within each frame."""
    padded = np.pad(mask, ((0, 0), (1, 1), (1, 1)))
    h, w = mask.shape[1:]
    return np.any([padded[:, i:i + h, j:j + w] for i in range(3) for j in range(3)], axis=0)


def _soft_mask(seg: Segmentation, k: int) -> np.ndarray:
    """(T, H, W) coverage of palette colour k, measured against the object's actual colour."""
    own = seg.label == k
    interior = own & (seg.alpha >= INTERIOR_ALPHA)
    colour = np.median(seg.frames[interior], axis=0) if interior.any() else _PALETTE[k]
    axes = colour[None, :] - seg.background  # (T, 3)
    metric = axes @ _COVERAGE_METRIC  # (T, 3): projecting with the luma-weighted inner product
    norm2 = np.maximum((metric * axes).sum(-1), 1.0)
    offset = seg.frames - seg.background[:, None, None, :]
    alpha = np.clip(np.einsum("thwc,tc->thw", offset, metric) / norm2[:, None, None], 0.0, 1.0)
    grown = own | (_dilate(own) & (seg.label == -1))  # edge pixels a codec pushed off the colour
    return np.where(grown, alpha, 0.0)


# ---------------------------------------------------------------------------------------------
# Localisation


def _box_sum(mask: np.ndarray, k: int) -> np.ndarray:
    """Sum of (T, H, W) `mask` over a k x k box (k odd) around every pixel, zero outside."""
    p = k // 2
    c = np.pad(mask, ((0, 0), (p + 1, p), (p + 1, p))).cumsum(1).cumsum(2)
    return c[:, k:, k:] - c[:, :-k, k:] - c[:, k:, :-k] + c[:, :-k, :-k]


def _crops(stack: np.ndarray, iy: np.ndarray, ix: np.ndarray, h: int) -> np.ndarray:
    """(T, 2h+1, 2h+1, ...) windows of `stack` (T, H, W, ...) centred on pixels (iy, ix), 0 outside."""
    pad = [(0, 0), (h, h), (h, h)] + [(0, 0)] * (stack.ndim - 3)
    padded = np.pad(stack, pad)
    off = np.arange(-h, h + 1)
    rows = (iy + h)[:, None, None] + off[None, :, None]
    cols = (ix + h)[:, None, None] + off[None, None, :]
    return padded[np.arange(len(iy))[:, None, None], rows, cols]


def _window_stats(crop: np.ndarray, iy: np.ndarray, ix: np.ndarray, h: int):
    """Area (T,) and centroid (T, 2) of crops centred on pixels (iy, ix)."""
    off = np.arange(-h, h + 1) + 0.5
    area = crop.sum((1, 2))
    safe = np.maximum(area, 1e-9)
    cy = iy + (crop.sum(2) * off).sum(1) / safe
    cx = ix + (crop.sum(1) * off).sum(1) / safe
    return area, np.stack([cy, cx], axis=1)


def _locate(mask: np.ndarray, short: int):
    """Per frame: window half-size, crop (T, K, K), its centre pixels, area and centroid."""
    t, height, width = mask.shape
    k = 2 * max(1, round(SIZE_RANGE[0] * short)) + 1
    h = math.ceil(1.5 * SIZE_RANGE[1] * short) + 1
    peak = _box_sum(mask, k).reshape(t, -1).argmax(1)
    iy, ix = np.divmod(peak, width)
    for _ in range(2):  # the peak, then re-centred on the centroid
        crop = _crops(mask, iy, ix, h)
        area, centroid = _window_stats(crop, iy, ix, h)
        moved = area > 0
        iy = np.where(moved, np.clip(np.floor(centroid[:, 0]), 0, height - 1), iy).astype(int)
        ix = np.where(moved, np.clip(np.floor(centroid[:, 1]), 0, width - 1), ix).astype(int)
    crop = _crops(mask, iy, ix, h)
    area, centroid = _window_stats(crop, iy, ix, h)
    return h, crop, iy, ix, area, centroid


# ---------------------------------------------------------------------------------------------
# Shape by analysis-by-synthesis


def _blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur of the last two (square) axes, zero outside; sigma in pixels."""
    if sigma <= 0:
        return image
    index = np.arange(image.shape[-1])
    kernel = np.exp(-0.5 * ((index[:, None] - index[None, :]) / sigma) ** 2)  # (K, K), symmetric
    reach = np.arange(-math.ceil(4 * sigma), math.ceil(4 * sigma) + 1)
    kernel /= np.exp(-0.5 * (reach / sigma) ** 2).sum()  # unit sum away from the edges
    return kernel @ image @ kernel  # rows, then columns


def _fit_shapes(crop, iy, ix, h, area, centroid):
    """Per frame and shape: least normalised squared error (P, S) and its radius (P, S)."""
    count = len(area)
    off = np.arange(-h, h + 1) + 0.5
    ys = (iy[:, None] + off[None, :])[:, None, None, :, None]  # (P, 1, 1, K, 1)
    xs = (ix[:, None] + off[None, :])[:, None, None, None, :]
    oy, ox = (g.ravel() for g in np.meshgrid(CENTRE_OFFSETS, CENTRE_OFFSETS, indexing="ij"))
    cy = (centroid[:, 0, None] + oy[None, :])[:, None, :, None, None]  # (P, 1, O, 1, 1)
    cx = (centroid[:, 1, None] + ox[None, :])[:, None, :, None, None]
    errors, radii = [], []
    for shape in SHAPES:
        r = np.sqrt(area / _AREA_PER_R2[shape])[:, None] * RADIUS_SCALES[None, :]  # (P, R)
        cover = _coverage(shape, (cy, cx), r[:, :, None, None, None], ys, xs, antialias=True)
        sse = np.stack([  # (P, B, R, O): per blur, radius and centre offset
            ((_blur(cover, sigma) - crop[:, None, None]) ** 2).sum((-2, -1)) for sigma in BLUR_SIGMAS
        ], axis=1).reshape(count, -1)
        best = sse.argmin(1)
        errors.append(sse[np.arange(count), best] / np.maximum(area, 1.0))
        radii.append(r[np.arange(count), (best // len(oy)) % len(RADIUS_SCALES)])
    return np.stack(errors, 1), np.stack(radii, 1)


# ---------------------------------------------------------------------------------------------
# Motion


def _axis_errors(obs, times, velocity, start, lo, hi):
    """Mean squared error (M, R, G) of bounced paths from `start` (M or 1, R, G) along one axis."""
    free = start[..., None] + velocity[:, None, None, None] * times  # (M, R, G, P)
    path = np.empty_like(free)
    for j in range(len(lo)):  # _reflect takes scalar walls
        path[:, j] = _reflect(free[:, j], float(lo[j]), float(hi[j]))
    return ((path - obs) ** 2).mean(-1)


def _axis_fit(obs: np.ndarray, times: np.ndarray, velocity: np.ndarray, r: np.ndarray, side: int):
    """Least mean squared error of the bounced path along one axis, over start positions.

    obs, times: (P,); velocity: (M,) pixels per frame; r: (R,). Starts are tried on a coarse grid
    over [r, side - r], then on a fine one (MOTION_STEP) around the best coarse start.
    Returns error (M, R) and start (M, R).
    """
    lo, hi = r, side - r  # (R,)
    span = np.maximum(hi - lo, 0.0)
    coarse = 4 * MOTION_STEP
    u = np.linspace(0.0, 1.0, max(2, int(math.ceil(float(span.max()) / coarse)) + 1))
    start = (lo[:, None] + span[:, None] * u[None, :])[None]  # (1, R, G)
    error = _axis_errors(obs, times, velocity, start, lo, hi)
    best = np.take_along_axis(np.broadcast_to(start, error.shape), error.argmin(-1)[..., None], -1)
    fine = np.arange(-4, 5) * MOTION_STEP  # covers the coarse step on both sides
    start = np.clip(best + fine, lo[None, :, None], hi[None, :, None])  # (M, R, 9)
    error = _axis_errors(obs, times, velocity, start, lo, hi)
    pick = error.argmin(-1)[..., None]
    return np.take_along_axis(error, pick, -1)[..., 0], np.take_along_axis(start, pick, -1)[..., 0]


def _fit_motion(centroid, present, radius, height, width):
    """Best (direction, speed), start, RMS residual and the errors of all candidates."""
    short = min(height, width)
    times = np.flatnonzero(present).astype(np.float64)
    obs = centroid[present]
    r = np.maximum(radius * MOTION_RADIUS_SCALES, 0.5)
    vy = np.array([DIRECTIONS[d][0] * SPEEDS[s] * short for d, s in _MOTIONS])
    vx = np.array([DIRECTIONS[d][1] * SPEEDS[s] * short for d, s in _MOTIONS])
    ey, sy = _axis_fit(obs[:, 0], times, vy, r, height)
    ex, sx = _axis_fit(obs[:, 1], times, vx, r, width)
    total = ey + ex  # (M, R): mean squared distance
    m, j = np.unravel_index(total.argmin(), total.shape)
    errors = {motion: float(np.sqrt(total[i].min())) for i, motion in enumerate(_MOTIONS)}
    t = np.arange(len(present), dtype=np.float64)
    path = np.stack([
        _reflect(sy[m, j] + vy[m] * t, r[j], height - r[j]),
        _reflect(sx[m, j] + vx[m] * t, r[j], width - r[j]),
    ], axis=1)
    return _MOTIONS[m], (float(sy[m, j]), float(sx[m, j])), float(np.sqrt(total[m, j])), errors, path


def motion_tolerance(height: int, width: int) -> float:
    """Largest RMS residual (pixels) of a consistent motion: max(1, MOTION_TOLERANCE x short side)."""
    return max(1.0, MOTION_TOLERANCE * min(height, width))


# ---------------------------------------------------------------------------------------------
# Detection


def _consistency(present, area, frame_shapes, shape, mean_colour) -> tuple[float, dict]:
    if not present.any():
        parts = {"presence": 0.0, "size": 0.0, "shape": 0.0, "colour": 0.0}
        return 0.0, parts
    a = area[present]
    colours = mean_colour[present & np.isfinite(mean_colour).all(1)]
    colour_std = float(np.sqrt(colours.var(0).sum())) if len(colours) else PALETTE_GAP
    parts = {
        "presence": float(present.mean()),
        "size": 1.0 - min(1.0, float(a.std() / max(a.mean(), 1e-9))),
        "shape": float(np.mean([s == shape for s, p in zip(frame_shapes, present) if p])),
        "colour": 1.0 - min(1.0, colour_std / PALETTE_GAP),
    }
    return float(np.mean(list(parts.values()))), parts


def _vote_shape(choice: np.ndarray, errors: np.ndarray, radii: np.ndarray):
    """The majority of per-frame shapes `choice` (ties: least summed error) and its radius."""
    votes = np.bincount(choice, minlength=len(SHAPES))
    tied = np.flatnonzero(votes == votes.max())
    winner = int(tied[errors[:, tied].sum(0).argmin()])
    return winner, float(np.median(radii[choice == winner, winner]))


def _region_colours(seg, iy, ix, h, centroid, reach) -> np.ndarray:
    """(T, len(COLORS)) labelled alpha per palette colour within `reach` (T,) px of the centroid."""
    off = np.arange(-h, h + 1) + 0.5
    label, alpha = _crops(seg.label, iy, ix, h), _crops(seg.alpha, iy, ix, h)
    dist = np.hypot(
        (iy[:, None, None] + off[None, :, None]) - centroid[:, 0, None, None],
        (ix[:, None, None] + off[None, None, :]) - centroid[:, 1, None, None],
    )
    near = (dist <= reach[:, None, None]) & (label >= 0)
    frame = np.broadcast_to(np.arange(len(iy))[:, None, None], near.shape)
    index = frame[near] * len(COLORS) + label[near]
    share = np.bincount(index, weights=alpha[near], minlength=len(iy) * len(COLORS))
    return share.reshape(len(iy), len(COLORS))


def _mean_colours(seg, iy, ix, h, crop, present) -> np.ndarray:
    """(T, 3) coverage-weighted mean over pixels of coverage >= 0.5 of the colour un-mixed from
    the background, bg + (pixel - bg) / coverage; NaN where absent."""
    bg = seg.background[:, None, None, :]
    interior = crop >= 0.5
    unmixed = bg + (_crops(seg.frames, iy, ix, h) - bg) / np.maximum(crop, 0.5)[..., None]
    weight = (crop * interior)[..., None]  # (T, K, K, 1)
    colours = np.full((len(crop), 3), np.nan)
    has = present & interior.any((1, 2))
    colours[has] = (unmixed[has] * weight[has]).sum((1, 2)) / weight[has].sum((1, 2))
    return colours


def _detect(seg: Segmentation, color: str) -> Track:
    choose(color, COLORS, "color")
    k = list(COLORS).index(color)
    t, height, width = seg.label.shape
    short = min(height, width)
    h, crop, iy, ix, area, centroid = _locate(_soft_mask(seg, k), short)
    min_area = max(1.0, MIN_AREA_FRACTION * _AREA_PER_R2["triangle"] * (SIZE_RANGE[0] * short) ** 2)
    present = area >= min_area
    p = np.flatnonzero(present)

    radius, frame_shapes = np.full(t, np.nan), [None] * t
    shape, track_radius = None, float("nan")
    occluded = np.zeros(t, dtype=bool)
    if len(p):
        errors, radii = _fit_shapes(crop[p], iy[p], ix[p], h, area[p], centroid[p])
        choice = errors.argmin(1)
        radius[p] = radii[np.arange(len(p)), choice]
        for frame, c in zip(p, choice):
            frame_shapes[frame] = SHAPES[c]
        shares = _region_colours(seg, iy, ix, h, centroid, np.where(present, radius + 1.0, 0.0))
        others = shares.sum(1) - shares[:, k]
        occluded = present & (others > OCCLUSION_FRACTION * area)
        clear = ~occluded[p] if (~occluded[p]).any() else np.ones(len(p), dtype=bool)
        winner, track_radius = _vote_shape(choice[clear], errors[clear], radii[clear])
        shape = SHAPES[winner]
    region = {name: float(v) for name, v in zip(COLORS, shares.sum(0)) if v > 0} if len(p) else {}
    mean_colour = _mean_colours(seg, iy, ix, h, crop, present)

    direction = speed = start = path = None
    residual, motion_errors = float("inf"), {}
    if len(p) >= MIN_MOTION_FRAMES:
        clear = present & ~occluded
        fit = clear if clear.sum() >= max(MIN_MOTION_FRAMES, len(p) / 2) else present
        (d, s), start, residual, motion_errors, path = _fit_motion(
            centroid, fit, track_radius, height, width)
        if len(p) >= t / 2 and residual <= motion_tolerance(height, width):
            direction, speed = d, s

    consistency, parts = _consistency(present, area, frame_shapes, shape, mean_colour)
    return Track(
        color=color, present=present, area=area, centroid=np.where(present[:, None], centroid, np.nan),
        radius=radius, occluded=occluded, frame_shapes=tuple(frame_shapes), mean_colour=mean_colour,
        shape=shape, radius_px=track_radius, direction=direction, speed=speed, start=start, path=path,
        motion_residual=residual, motion_errors=motion_errors, region_colours=region,
        consistency=consistency, consistency_parts=parts,
    )


def detect(video, color: str) -> Track:
    """Find and measure the object of palette colour `color` in `video`.

    `video` is uint8 (T, H, W, 3) or float (3, T, H, W) in [-1, 1]. See the module docstring for
    how each field of the returned `Track` is measured.
    """
    return _detect(segment(video), color)


# ---------------------------------------------------------------------------------------------
# Scoring


def _nearest_background(rgb: np.ndarray) -> str:
    names = list(BACKGROUNDS)
    distance = [np.linalg.norm(rgb - np.asarray(BACKGROUNDS[n], dtype=np.float64)) for n in names]
    return names[int(np.argmin(distance))]


def score(video, prompt: str) -> dict:
    """Check `video` against `prompt` (the `shapes.caption` grammar; bad prompts raise UserError).

    Returns {"objects": [one dict per object of the prompt], "color_ok", "shape_ok",
    "direction_ok", "speed_ok", "aligned", "consistency", "background", "background_ok"}. Each
    object dict holds what was asked ("color", "shape", "direction", "speed"), what was detected
    ("detected_shape", "detected_direction", "detected_speed", "present_fraction",
    "color_share", "dominant_color", "motion_residual"), its checks and its consistency. The
    clip-level booleans are the conjunction over objects; "speed_ok" is None when no object states
    a speed, and "background_ok" None when the prompt names no background. Neither is part of
    "aligned" (see the module docstring, step 8).
    """
    wanted = parse_caption(prompt)
    seg = segment(video)
    objects = []
    for obj in wanted.objects:
        track = _detect(seg, obj.color)
        others = {o.color for o in wanted.objects} - {obj.color}
        dominant = track.dominant_color(ignore=others)
        color_ok = track.present_fraction >= 0.5 and dominant == obj.color
        shape_ok = track.shape == obj.shape
        direction_ok = track.direction == obj.direction
        speed_ok = None if obj.speed is None else track.speed == obj.speed
        heading_ok = track.heading == obj.direction
        objects.append({
            "color": obj.color, "shape": obj.shape, "direction": obj.direction, "speed": obj.speed,
            "detected_shape": track.shape, "detected_direction": track.direction,
            "detected_speed": track.speed, "present_fraction": track.present_fraction,
            "color_share": track.color_share(ignore=others), "dominant_color": dominant,
            "motion_residual": track.motion_residual,
            "color_ok": bool(color_ok), "shape_ok": shape_ok, "direction_ok": direction_ok,
            "speed_ok": speed_ok, "heading": track.heading, "heading_ok": heading_ok,
            "aligned": bool(color_ok and shape_ok and direction_ok),
            "consistency": track.consistency,
        })
    speeds = [o["speed_ok"] for o in objects if o["speed_ok"] is not None]
    background = _nearest_background(np.median(seg.background, axis=0))
    return {
        "objects": objects,
        "color_ok": all(o["color_ok"] for o in objects),
        "shape_ok": all(o["shape_ok"] for o in objects),
        "direction_ok": all(o["direction_ok"] for o in objects),
        "speed_ok": all(speeds) if speeds else None,
        "heading_ok": all(o["heading_ok"] for o in objects),
        "aligned": all(o["aligned"] for o in objects),
        "consistency": float(np.mean([o["consistency"] for o in objects])),
        "background": background,
        "background_ok": None if wanted.background is None else background == wanted.background,
    }


def summarize(scores: list[dict]) -> dict[str, float]:
    """Rates over clips of each check ("color_ok", ..., "aligned"), the mean "consistency" and the
    clip "count". A rate counts only the clips where the check applies (speed_ok, background_ok
    may be None); with none it is NaN."""
    check(len(scores) >= 1, "scores must hold at least one score() result, got none")
    out: dict[str, float] = {}
    for key in ("color_ok", "shape_ok", "direction_ok", "heading_ok", "speed_ok", "background_ok", "aligned"):
        values = [s[key] for s in scores if s[key] is not None]
        out[key] = float(np.mean(values)) if values else float("nan")
    out["consistency"] = float(np.mean([s["consistency"] for s in scores]))
    out["count"] = float(len(scores))
    return out
