"""Procedural captioned moving shapes: a tiny text-to-video task with known ground truth.

A scene is a few coloured shapes on a dark background, each moving in a straight line and bouncing
off the frame edges. Everything is drawn from small vocabularies, so a caption can be generated from
the scene and parsed back, and evaluation code can check what a prompt asked for.

Units: positions and sizes in a `ShapeObject` are fractions of the frame (y of the height, x of the
width, size of the shorter side), so one scene renders at any resolution. Rendering works in pixels
with pixel centres at (i + 0.5); y grows downwards, so "up" is -y.
"""

import math
import re
from dataclasses import dataclass, replace
from numbers import Real
from collections.abc import Sequence

import numpy as np
from torch.utils.data import Dataset

from slidefusion.data.video_io import from_uint8
from slidefusion.core.errors import UserError, check, choose

# Saturated hues far apart, so a colour mask (or a metric) can tell objects apart after lossy coding.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 100, 255),
    "yellow": (245, 225, 40),
    "magenta": (225, 50, 225),
    "cyan": (40, 220, 230),
    "white": (245, 245, 245),
    "orange": (255, 140, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
_S = 1.0 / math.sqrt(2.0)
# Unit vectors in (dy, dx), image convention: +y is down.
DIRECTIONS: dict[str, tuple[float, float]] = {
    "left": (0.0, -1.0),
    "right": (0.0, 1.0),
    "up": (-1.0, 0.0),
    "down": (1.0, 0.0),
    "up-left": (-_S, -_S),
    "up-right": (-_S, _S),
    "down-left": (_S, -_S),
    "down-right": (_S, _S),
}
# Distance per frame as a fraction of the shorter frame side, so motion looks the same at any size.
SPEEDS: dict[str, float] = {"slowly": 0.02, "quickly": 0.05}
# Dark backgrounds keep every colour in COLORS clearly distinct from the background.
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0),
    "gray": (60, 60, 60),
    "navy": (15, 20, 70),
}

SIZE_RANGE = (0.08, 0.15)  # sampled radius, fraction of the shorter side
START_RANGE = (0.2, 0.8)  # sampled start centre, fraction of each side
MIN_RADIUS_PX = 1.0  # keeps every shape at least ~2 px across, even in a 5x7 frame
# Where a clip's objects start: "uniform" anywhere in START_RANGE (they may bounce off a wall
# within the clip), "clear" with room ahead, so each moves the way its caption says for the whole
# clip (if its path is longer than the frame, it starts at the wall behind it and bounces late),
# "behind" as "clear" but within the back BEHIND_SHARE of that room along each axis of motion, so
# that where the object is in each frame, not only how it moves between frames, says its direction.
START_MODES = ("uniform", "clear", "behind")
BEHIND_SHARE = 1.0 / 3.0


def _valid(name: str, value: str, vocabulary) -> None:
    choose(value, vocabulary, name)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ShapeObject:
    """One moving shape. `size` is the radius as a fraction of the shorter frame side (0, 0.5];
    `start_y`, `start_x` are the centre at frame 0 as fractions of height and width, in [0, 1]."""

    color: str
    shape: str
    direction: str
    speed: str
    size: float
    start_y: float
    start_x: float

    def __post_init__(self):
        _valid("color", self.color, COLORS)
        _valid("shape", self.shape, SHAPES)
        _valid("direction", self.direction, DIRECTIONS)
        _valid("speed", self.speed, SPEEDS)
        ok_size = isinstance(self.size, Real) and 0 < self.size <= 0.5
        check(ok_size, f"size must be in (0, 0.5], got {self.size!r}")
        for name in ("start_y", "start_x"):
            value = getattr(self, name)
            check(isinstance(value, Real) and 0 <= value <= 1, f"{name} must be in [0, 1], got {value!r}")


@dataclass(frozen=True)
class ShapeScene:
    """Shapes drawn in order (later ones on top) over a plain background."""

    objects: tuple[ShapeObject, ...]
    background: str

    def __post_init__(self):
        object.__setattr__(self, "objects", tuple(self.objects))
        check(len(self.objects) >= 1, "objects must hold at least one ShapeObject, got none")
        check(all(isinstance(o, ShapeObject) for o in self.objects), "objects must all be ShapeObject")
        _valid("background", self.background, BACKGROUNDS)


@dataclass(frozen=True)
class ObjectDescription:
    """What a caption says about one object; `speed` is None when the text does not say."""

    color: str
    shape: str
    direction: str
    speed: str | None


@dataclass(frozen=True)
class SceneDescription:
    """What a caption asks for; `background` is None when the text does not say."""

    objects: tuple[ObjectDescription, ...]
    background: str | None


# ---------------------------------------------------------------------------------------------
# Sampling


def _check_backgrounds(backgrounds: Sequence[str] | None) -> tuple[str, ...]:
    """The allowed background names; None means all of BACKGROUNDS."""
    if backgrounds is None:
        return tuple(BACKGROUNDS)
    backgrounds = (backgrounds,) if isinstance(backgrounds, str) else tuple(backgrounds)
    check(len(backgrounds) >= 1, f"backgrounds must name at least one of: {', '.join(BACKGROUNDS)}")
    for name in backgrounds:
        _valid("backgrounds", name, BACKGROUNDS)
    return backgrounds


def _check_max_objects(max_objects) -> None:
    check(
        _is_int(max_objects) and 1 <= max_objects <= len(COLORS),
        f"max_objects must be an int in [1, {len(COLORS)}] (one colour per object), got {max_objects!r}",
    )


def _sample_object(rng: np.random.Generator, color: str) -> ShapeObject:
    lo, hi = START_RANGE
    return ShapeObject(
        color=color,
        shape=SHAPES[rng.integers(len(SHAPES))],
        direction=list(DIRECTIONS)[rng.integers(len(DIRECTIONS))],
        speed=list(SPEEDS)[rng.integers(len(SPEEDS))],
        size=float(rng.uniform(*SIZE_RANGE)),
        start_y=float(rng.uniform(lo, hi)),
        start_x=float(rng.uniform(lo, hi)),
    )


def _clear_start(u: float, d: float, travel: float, r: float, side: int, share: float = 1.0) -> float:
    """Start centre as a fraction of `side`, from u in START_RANGE, leaving `travel` pixels clear
    ahead along an axis where the object moves by d (a unit-vector component) per step; `share`
    (0, 1] keeps it within that part of the clear room nearest the wall behind it."""
    lo, hi = START_RANGE
    if d == 0:
        return u
    room = share * max(side - 2 * r - travel, 0.0)  # pixels of clear room the start may use
    behind = r if d > 0 else side - r  # centre touching the wall the object moves away from
    f = (u - lo) / (hi - lo)  # position within the room, 0 at the back wall when d > 0
    return (behind + f * room if d > 0 else behind - (1 - f) * room) / side


def with_clear_path(obj: ShapeObject, frames: int, height: int, width: int, share: float = 1.0) -> ShapeObject:
    """`obj` moved (same caption, same size) so that its first bounce comes after `frames` frames;
    with `share` < 1 it starts within that share of the clear room nearest the wall behind it."""
    r = radius_px(obj, height, width)
    travel = SPEEDS[obj.speed] * min(height, width) * (frames - 1)  # pixels along the direction
    dy, dx = DIRECTIONS[obj.direction]
    return replace(obj, start_y=_clear_start(obj.start_y, dy, abs(dy) * travel, r, height, share),
                   start_x=_clear_start(obj.start_x, dx, abs(dx) * travel, r, width, share))


def with_start(obj: ShapeObject, start: str, frames: int, height: int, width: int) -> ShapeObject:
    """`obj` placed as the start mode `start` (START_MODES) places it in a clip of that size."""
    _valid("start", start, START_MODES)
    if start == "uniform":
        return obj
    return with_clear_path(obj, frames, height, width, share=BEHIND_SHARE if start == "behind" else 1.0)


def sample_scene(
    rng: np.random.Generator, max_objects: int = 2, backgrounds: Sequence[str] | None = None,
    start: str = "uniform", clip: tuple[int, int, int] | None = None,
) -> ShapeScene:
    """A random scene with 1..max_objects objects of pairwise different colours.

    Colours differ so that a caption names each object unambiguously and a colour mask finds it.
    `start` is one of START_MODES; "clear" needs `clip` = (frames, height, width) of the video the
    scene will be rendered at. The random draws are the same in both modes, so one seed gives the
    same captions and sizes either way; only start positions differ.
    """
    _check_max_objects(max_objects)
    allowed = _check_backgrounds(backgrounds)
    _valid("start", start, START_MODES)
    check(start == "uniform" or clip is not None, f"start={start!r} needs clip=(frames, height, width)")
    count = int(rng.integers(1, max_objects + 1))
    colors = rng.choice(len(COLORS), size=count, replace=False)
    objects = tuple(_sample_object(rng, list(COLORS)[c]) for c in colors)
    if start != "uniform":
        objects = tuple(with_start(o, start, *clip) for o in objects)
    return ShapeScene(objects=objects, background=allowed[rng.integers(len(allowed))])


# ---------------------------------------------------------------------------------------------
# Captions


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _object_phrase(obj: ShapeObject) -> str:
    return f"{_article(obj.color)} {obj.color} {obj.shape} moving {obj.direction} {obj.speed}"


def caption(scene: ShapeScene) -> str:
    """The caption of `scene`, e.g. "a red circle moving right quickly and an orange square moving
    up-left slowly on a gray background".

    Grammar: OBJECT (" and " OBJECT)* " on " ART BACKGROUND " background", where OBJECT is
    ART COLOR SHAPE " moving " DIRECTION " " SPEED and ART is "an" before a vowel, else "a".
    """
    objects = " and ".join(_object_phrase(o) for o in scene.objects)
    return f"{objects} on {_article(scene.background)} {scene.background} background"


def describe(scene: ShapeScene) -> SceneDescription:
    """The parts of `scene` that its caption states (drops sizes and start positions)."""
    objects = tuple(ObjectDescription(o.color, o.shape, o.direction, o.speed) for o in scene.objects)
    return SceneDescription(objects=objects, background=scene.background)


_BACKGROUND_RE = re.compile(r"^(?P<objects>.+) on an? (?P<background>\S+) background$")
_OBJECT_RE = re.compile(r"^an? (?P<color>\S+) (?P<shape>\S+) moving (?P<direction>\S+)(?: (?P<speed>\S+))?$")
_GRAMMAR = "'a <color> <shape> moving <direction> [<speed>] [and ...] [on a <background> background]'"


def _parse_word(kind: str, word: str | None, vocabulary, text: str) -> str | None:
    if word is not None and word not in vocabulary:
        raise UserError(f"caption: unknown {kind} {word!r} in {text!r}; valid: {', '.join(vocabulary)}")
    return word


def _parse_object(phrase: str, text: str) -> ObjectDescription:
    match = _OBJECT_RE.match(phrase)
    if match is None:
        raise UserError(f"caption: cannot parse {phrase!r} in {text!r}; expected {_GRAMMAR}")
    return ObjectDescription(
        color=_parse_word("color", match["color"], COLORS, text),
        shape=_parse_word("shape", match["shape"], SHAPES, text),
        direction=_parse_word("direction", match["direction"], DIRECTIONS, text),
        speed=_parse_word("speed", match["speed"], SPEEDS, text),
    )


def parse_caption(text: str) -> SceneDescription:
    """What a caption in the `caption` grammar asks for.

    Lenient where prompts written by people vary: case, extra spaces, a trailing full stop, either
    article, and a missing speed or background clause (reported as None). Text outside the grammar
    or words outside the vocabularies raise UserError.
    """
    check(isinstance(text, str), f"caption must be a str, got {type(text).__name__}")
    normal = " ".join(text.lower().strip().rstrip(".").split())
    match = _BACKGROUND_RE.match(normal)
    phrases, background = (match["objects"], match["background"]) if match else (normal, None)
    background = _parse_word("background", background, BACKGROUNDS, text)
    objects = tuple(_parse_object(p, text) for p in phrases.split(" and "))
    return SceneDescription(objects=objects, background=background)


_MOVING_RE = re.compile(r"\bmoving (\S+)")


def with_other_direction(text: str, offset: int) -> str | None:
    """`text` with every object's direction replaced by the one `offset` (1..7) places further in
    DIRECTIONS, the rest of the caption unchanged, e.g. offset 1 turns "left" into "right"; None
    when `text` names no direction of the vocabulary (an empty caption, a free-form prompt).

    The negative caption of the direction contrast (`diffusion.direction_contrast`): the same
    words, a different motion."""
    check(isinstance(offset, int) and 1 <= offset < len(DIRECTIONS),
          f"offset={offset!r} must be an int in 1..{len(DIRECTIONS) - 1}")
    names = list(DIRECTIONS)
    words = _MOVING_RE.findall(text)
    if not words or any(w not in DIRECTIONS for w in words):
        return None
    return _MOVING_RE.sub(lambda m: "moving " + names[(names.index(m[1]) + offset) % len(names)], text)


# ---------------------------------------------------------------------------------------------
# Rendering


def radius_px(obj: ShapeObject, height: int, width: int) -> float:
    """The object's radius in pixels (circumradius for triangle/diamond/square half-side)."""
    return max(obj.size * min(height, width), MIN_RADIUS_PX)


def _reflect(position: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Fold free-flight positions into [lo, hi] as if bouncing elastically off both walls."""
    span = hi - lo
    if span <= 0:  # the shape is wider than the frame: it cannot move, keep it centred
        return np.full_like(position, (lo + hi) / 2)
    phase = np.mod(position - lo, 2 * span)
    return lo + np.where(phase <= span, phase, 2 * span - phase)


def object_centers(obj: ShapeObject, frames: int, height: int, width: int) -> np.ndarray:
    """Centre of `obj` in every frame, float64 (frames, 2) as (y, x) in pixels.

    Closed form (no stepping), so frame t does not depend on how many frames came before it. The
    centre stays within [r, side - r] on each axis, so the whole shape stays inside the frame.
    """
    r = radius_px(obj, height, width)
    step = SPEEDS[obj.speed] * min(height, width)  # pixels per frame
    dy, dx = DIRECTIONS[obj.direction]
    t = np.arange(frames, dtype=np.float64)
    y = _reflect(obj.start_y * height + dy * step * t, r, height - r)
    x = _reflect(obj.start_x * width + dx * step * t, r, width - r)
    return np.stack([y, x], axis=1)


def _signed_distance(shape: str, dy: np.ndarray, dx: np.ndarray, r: float) -> np.ndarray:
    """Signed distance in pixels from offsets (dy, dx) to the shape's edge; negative inside."""
    if shape == "circle":
        return np.hypot(dy, dx) - r
    if shape == "square":
        return np.maximum(np.abs(dy), np.abs(dx)) - r
    if shape == "diamond":
        return (np.abs(dy) + np.abs(dx) - r) * _S
    # Equilateral triangle pointing up with circumradius r: intersection of three half-planes.
    h = math.sqrt(3.0) / 2
    bottom = dy - r / 2
    right, left = -dy / 2 + h * dx - r / 2, -dy / 2 - h * dx - r / 2
    return np.maximum(bottom, np.maximum(right, left))


def _coverage(shape: str, center: np.ndarray, r: float, ys: np.ndarray, xs: np.ndarray, antialias: bool):
    """Fraction (H, W) in [0, 1] of each pixel covered by the shape."""
    distance = _signed_distance(shape, ys - center[0], xs - center[1], r)
    if antialias:  # a 1-px linear ramp across the edge approximates the covered area
        return np.clip(0.5 - distance, 0.0, 1.0)
    return (distance <= 0).astype(np.float64)


def _check_size(frames, height, width) -> None:
    for name, value in (("frames", frames), ("height", height), ("width", width)):
        check(_is_int(value) and value >= 1, f"{name} must be an int >= 1, got {value!r}")


def render(scene: ShapeScene, frames: int, height: int, width: int, antialias: bool = True) -> np.ndarray:
    """Draw `scene` as uint8 RGB video of shape (frames, height, width, 3)."""
    _check_size(frames, height, width)
    ys = (np.arange(height, dtype=np.float64) + 0.5)[:, None]  # (H, 1) pixel centres
    xs = (np.arange(width, dtype=np.float64) + 0.5)[None, :]  # (1, W)
    video = np.empty((frames, height, width, 3), dtype=np.float64)
    video[:] = BACKGROUNDS[scene.background]
    for obj in scene.objects:
        centers = object_centers(obj, frames, height, width)  # (T, 2)
        r = radius_px(obj, height, width)
        color = np.asarray(COLORS[obj.color], dtype=np.float64)
        for t in range(frames):
            alpha = _coverage(obj.shape, centers[t], r, ys, xs, antialias)[..., None]  # (H, W, 1)
            video[t] = video[t] * (1 - alpha) + color * alpha
    return np.rint(video).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# Dataset


class MovingShapes(Dataset):
    """`num_samples` captioned clips of moving shapes, each a pure function of (seed, index).

    `start` (START_MODES) says where objects start: "uniform" (they may bounce within the clip),
    "clear" (room ahead for the whole clip) or "behind" (clear, and near the wall behind them).

    Item i is {"video": float32 (3, frames, height, width) in [-1, 1], "caption": str}. Because
    every item seeds its own generator from (seed, i), items are identical in any worker, any order.
    """

    def __init__(
        self,
        num_samples: int,
        frames: int,
        height: int,
        width: int,
        seed: int = 0,
        max_objects: int = 2,
        backgrounds: Sequence[str] | None = None,
        start: str = "uniform",
    ):
        check(_is_int(num_samples) and num_samples >= 1,
              f"num_samples must be an int >= 1, got {num_samples!r}")
        _check_size(frames, height, width)
        check(_is_int(seed) and seed >= 0, f"seed must be an int >= 0, got {seed!r}")
        _check_max_objects(max_objects)
        self.num_samples, self.frames, self.height, self.width = num_samples, frames, height, width
        self.seed, self.max_objects = int(seed), max_objects
        self.backgrounds = _check_backgrounds(backgrounds)
        _valid("start", start, START_MODES)
        self.start = start

    def __len__(self) -> int:
        return self.num_samples

    def _index(self, i: int) -> int:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"index {i} out of range for MovingShapes of length {self.num_samples}")
        return i % self.num_samples

    def scene(self, i: int) -> ShapeScene:
        """The scene behind item i."""
        rng = np.random.default_rng([self.seed, self._index(i)])
        return sample_scene(rng, self.max_objects, self.backgrounds, self.start, (self.frames, self.height, self.width))

    def __getitem__(self, i: int) -> dict:
        scene = self.scene(i)
        video = render(scene, self.frames, self.height, self.width)
        return {"video": from_uint8(video), "caption": caption(scene)}
