import numpy as np
import pytest
import torch

from slidefusion.data import build_dataset
from slidefusion.data.shapes import (
    BACKGROUNDS,
    BEHIND_SHARE,
    COLORS,
    DIRECTIONS,
    SHAPES,
    MovingShapes,
    ShapeObject,
    ShapeScene,
    caption,
    describe,
    object_centers,
    parse_caption,
    radius_px,
    render,
    sample_scene,
)
from slidefusion.core.errors import UserError


def _mask(video: np.ndarray, color: str, tol: float = 60.0) -> np.ndarray:
    """(T, H, W) bool: pixels within `tol` (RGB distance) of the named colour."""
    diff = video.astype(np.float64) - np.asarray(COLORS[color], dtype=np.float64)
    return np.linalg.norm(diff, axis=-1) < tol


def _centroid(mask: np.ndarray) -> np.ndarray:
    ys, xs = np.nonzero(mask)
    assert len(ys) > 0, "object not visible"
    return np.array([ys.mean(), xs.mean()])


def _one(shape="circle", direction="right", speed="slowly", size=0.1, y=0.5, x=0.5, color="red"):
    obj = ShapeObject(color, shape, direction, speed, size, y, x)
    return ShapeScene(objects=(obj,), background="black")


# --- determinism and value ranges --------------------------------------------------------------


def test_same_seed_and_index_give_identical_items():
    a, b = MovingShapes(8, 4, 16, 16, seed=3), MovingShapes(8, 4, 16, 16, seed=3)
    for i in (0, 5, 7):
        assert torch.equal(a[i]["video"], b[i]["video"])
        assert a[i]["caption"] == b[i]["caption"]
    # Reading out of order must not change anything: items depend on (seed, i) alone.
    assert torch.equal(a[7]["video"], MovingShapes(8, 4, 16, 16, seed=3)[7]["video"])
    assert a.scene(-1) == a.scene(7)


def test_different_seeds_and_indices_differ():
    a, b = MovingShapes(4, 4, 16, 16, seed=0), MovingShapes(4, 4, 16, 16, seed=1)
    assert not torch.equal(a[0]["video"], b[0]["video"])
    assert len({a[i]["caption"] for i in range(4)} | {b[i]["caption"] for i in range(4)}) > 4


@pytest.mark.parametrize("frames,height,width", [(1, 5, 7), (7, 17, 19), (3, 1, 1), (2, 64, 3)])
def test_odd_sizes_render_in_range(frames, height, width):
    ds = MovingShapes(3, frames, height, width, seed=1)
    for i in range(3):
        video = ds[i]["video"]
        assert video.shape == (3, frames, height, width) and video.dtype == torch.float32
        assert video.min() >= -1 and video.max() <= 1


def _area(video: np.ndarray, color: str) -> np.ndarray:
    """(T,) covered area in pixels of a `color` object on black: partial pixels count partly."""
    return video[..., 0].astype(np.float64).sum(axis=(1, 2)) / COLORS[color][0]


def test_tiny_frame_still_shows_the_shape():
    # A 5x7 frame must still show an object about 2 px across (area ~ pi * 1^2), not a speck.
    video = render(_one(size=0.01, y=0.45, x=0.55), 1, 5, 7)
    assert _area(video, "red")[0] >= 2.0


@pytest.mark.parametrize("shape,area_per_r2", [
    ("circle", np.pi), ("square", 4.0), ("diamond", 2.0), ("triangle", 3 * np.sqrt(3) / 4)])
def test_shapes_have_the_expected_area(shape, area_per_r2):
    # size 0.25 of 80 px: radius 20 px; antialiased coverage should match the geometry closely.
    video = render(_one(shape=shape, size=0.25, y=0.47, x=0.53), 1, 80, 80)
    assert _area(video, "red")[0] == pytest.approx(area_per_r2 * 20.0**2, rel=0.02)


def test_values_cover_range_and_video_layout():
    item = MovingShapes(1, 2, 32, 32, seed=0, backgrounds=["black"])[0]
    assert item["video"].min() == -1.0  # black background maps to exactly -1
    assert item["video"].max() > 0.5  # a bright object is there


def test_two_object_scenes_use_different_colors():
    rng = np.random.default_rng(0)
    scenes = [sample_scene(rng, max_objects=3) for _ in range(200)]
    assert {len(s.objects) for s in scenes} == {1, 2, 3}
    for s in scenes:
        colors = [o.color for o in s.objects]
        assert len(set(colors)) == len(colors)


# --- motion --------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_object_moves_in_captioned_direction(direction):
    video = render(_one(direction=direction), 8, 64, 64)
    shift = _centroid(_mask(video[7], "red")) - _centroid(_mask(video[0], "red"))
    dy, dx = DIRECTIONS[direction]
    assert np.sign(np.round(shift, 1)).tolist() == np.sign([dy, dx]).tolist()
    assert np.linalg.norm(shift) > 5  # 7 frames at 2% of 64 px per frame is ~9 px


def test_quickly_moves_further_than_slowly():
    slow = np.diff(object_centers(_one(speed="slowly").objects[0], 3, 64, 64)[:, 1])
    fast = np.diff(object_centers(_one(speed="quickly").objects[0], 3, 64, 64)[:, 1])
    assert np.all(fast > 2 * slow) and np.all(slow > 0)


@pytest.mark.parametrize("shape", SHAPES)
def test_bouncing_keeps_object_inside_and_reverses(shape):
    scene = _one(shape=shape, direction="down-right", speed="quickly", size=0.12, y=0.3, x=0.7)
    obj, frames, h, w = scene.objects[0], 120, 40, 48
    centers, r = object_centers(obj, frames, h, w), radius_px(obj, h, w)
    assert np.all(centers[:, 0] >= r - 1e-9) and np.all(centers[:, 0] <= h - r + 1e-9)
    assert np.all(centers[:, 1] >= r - 1e-9) and np.all(centers[:, 1] <= w - r + 1e-9)
    steps = np.sign(np.diff(centers[:, 1]))
    assert (steps > 0).any() and (steps < 0).any()  # it came back: a bounce happened
    # Never clipped by an edge: the visible area stays that of the first frame.
    area = _mask(render(scene, frames, h, w), obj.color).sum(axis=(1, 2))
    assert area.min() >= 0.85 * area[0] and area[0] > 10


# --- captions ------------------------------------------------------------------------------------


def test_caption_text_and_articles():
    first = ShapeObject("red", "circle", "right", "quickly", 0.1, 0.5, 0.5)
    second = ShapeObject("orange", "square", "up-left", "slowly", 0.1, 0.5, 0.5)
    assert caption(ShapeScene((first,), "black")) == "a red circle moving right quickly on a black background"
    assert caption(ShapeScene((first, second), "gray")) == (
        "a red circle moving right quickly and an orange square moving up-left slowly on a gray background"
    )


def test_caption_parse_round_trip_over_sampled_scenes():
    rng = np.random.default_rng(123)
    for _ in range(300):
        scene = sample_scene(rng, max_objects=3)
        assert parse_caption(caption(scene)) == describe(scene)


def test_parse_is_lenient_about_form_but_not_words():
    parsed = parse_caption("  A Blue  Triangle moving DOWN-LEFT.  ")
    assert parsed.background is None
    assert (parsed.objects[0].color, parsed.objects[0].shape, parsed.objects[0].direction) == (
        "blue", "triangle", "down-left")
    assert parsed.objects[0].speed is None
    with pytest.raises(UserError, match="unknown color 'pink'"):
        parse_caption("a pink circle moving up")
    with pytest.raises(UserError, match="unknown background"):
        parse_caption("a red circle moving up on a purple background")
    with pytest.raises(UserError, match="cannot parse"):
        parse_caption("a cat sitting")


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(frames=0), "frames must be an int >= 1, got 0"),
        (dict(height=-1), "height"),
        (dict(width=2.5), "width"),
        (dict(num_samples=0), "num_samples"),
        (dict(seed=-1), "seed"),
        (dict(max_objects=0), "max_objects"),
        (dict(max_objects=len(COLORS) + 1), "max_objects"),
        (dict(backgrounds=["pink"]), "backgrounds='pink' is unknown; valid: " + ", ".join(BACKGROUNDS)),
    ],
)
def test_bad_arguments_raise_user_error(kwargs, match):
    args = dict(num_samples=2, frames=2, height=8, width=8) | kwargs
    with pytest.raises(UserError, match=match):
        MovingShapes(**args)


def test_bad_scene_fields_raise_user_error():
    with pytest.raises(UserError, match="direction='sideways'"):
        ShapeObject("red", "circle", "sideways", "slowly", 0.1, 0.5, 0.5)
    with pytest.raises(UserError, match="start_x"):
        ShapeObject("red", "circle", "up", "slowly", 0.1, 0.5, 1.5)
    with pytest.raises(UserError, match="objects"):
        ShapeScene((), "black")


def test_index_out_of_range_is_index_error():
    ds = MovingShapes(2, 1, 4, 4)
    with pytest.raises(IndexError):
        ds[2]
    assert len(list(ds)) == 2  # plain iteration relies on IndexError at the end


def test_build_dataset():
    ds = build_dataset("shapes", num_samples=2, frames=2, height=8, width=8)
    assert isinstance(ds, MovingShapes) and len(ds) == 2
    with pytest.raises(UserError, match="valid: shapes, folder"):
        build_dataset("imagenet")
    with pytest.raises(UserError, match="valid arguments: num_samples"):
        build_dataset("shapes", num_samples=2, frames=2, height=8, width=8, fps=3)


@pytest.mark.parametrize("frames, height, width", [(8, 32, 32), (5, 17, 40)])
def test_clear_start_keeps_captions_and_never_bounces_within_the_clip(frames, height, width):
    uniform = MovingShapes(300, frames, height, width, seed=3, max_objects=2)
    clear = MovingShapes(300, frames, height, width, seed=3, max_objects=2, start="clear")
    bounced = 0
    for i in range(300):
        assert uniform[i]["caption"] == clear[i]["caption"]  # same draws: only start positions move
        for before, obj in zip(uniform.scene(i).objects, clear.scene(i).objects):
            assert obj.size == before.size
            unit = np.array(DIRECTIONS[obj.direction])
            progress = np.diff(object_centers(obj, frames, height, width), axis=0) @ unit  # px per frame
            speed = np.diff(object_centers(obj, 2, height, width), axis=0) @ unit
            assert np.allclose(progress, speed), (obj, progress)  # straight on, all frames
            old = np.diff(object_centers(before, frames, height, width), axis=0) @ unit
            bounced += not np.allclose(old, old[0])
    assert bounced > 10  # the uniform starts do bounce, so the check above had work to do


def test_clear_start_on_a_path_longer_than_the_frame_starts_at_the_wall_behind():
    data = MovingShapes(200, 32, 32, 32, seed=0, max_objects=1, start="clear")
    for i in range(200):
        obj = data.scene(i).objects[0]
        if obj.speed == "quickly" and obj.direction == "right":  # 1.6 px x 31 frames > 32 px
            centres = object_centers(obj, 32, 32, 32)
            assert centres[0, 1] == pytest.approx(radius_px(obj, 32, 32))
            assert (np.diff(centres[:10, 1]) > 0).all()
            break
    else:
        pytest.fail("no quick rightward clip among 200")


@pytest.mark.parametrize("frames, height, width", [(8, 32, 32), (5, 17, 40)])
def test_behind_start_is_clear_and_near_the_wall_behind(frames, height, width):
    clear = MovingShapes(300, frames, height, width, seed=4, max_objects=2, start="clear")
    behind = MovingShapes(300, frames, height, width, seed=4, max_objects=2, start="behind")
    for i in range(300):
        assert behind[i]["caption"] == clear[i]["caption"]
        for wide, obj in zip(clear.scene(i).objects, behind.scene(i).objects):
            r, unit = radius_px(obj, height, width), np.array(DIRECTIONS[obj.direction])
            centres = object_centers(obj, frames, height, width)
            progress = np.diff(centres, axis=0) @ unit
            assert np.allclose(progress, progress[0]) and progress[0] > 0  # clear: straight on
            travel = abs(progress[0]) * (frames - 1)
            for axis, d in enumerate(unit):
                side = (height, width)[axis]
                if d == 0:  # across the motion: the same start as "clear"
                    assert centres[0, axis] == pytest.approx(object_centers(wide, 1, height, width)[0, axis])
                    continue
                back = r if d > 0 else side - r
                room = max(side - 2 * r - abs(d) * travel, 0.0)
                assert abs(centres[0, axis] - back) <= BEHIND_SHARE * room + 1e-9, (obj, axis)


def test_behind_start_separates_where_each_direction_is_at_frame_0():
    data = MovingShapes(400, 8, 32, 32, seed=0, max_objects=1, start="behind")
    first_x = {"left": [], "right": []}
    for i in range(400):
        obj = data.scene(i).objects[0]
        if obj.direction in first_x:
            first_x[obj.direction].append(object_centers(obj, 1, 32, 32)[0, 1])
    assert max(first_x["right"]) < 16 < min(first_x["left"])  # left half / right half


def test_bad_start_is_a_user_error():
    with pytest.raises(UserError, match="start='late' is unknown; valid: uniform, clear, behind"):
        MovingShapes(2, 2, 8, 8, start="late")
    with pytest.raises(UserError, match="clip="):
        sample_scene(np.random.default_rng(0), start="clear")


def test_other_direction_changes_only_the_direction_words():
    from slidefusion.data.shapes import DIRECTIONS, with_other_direction

    text = "a red circle moving left quickly and an orange square moving down-right slowly on a gray background"
    names = list(DIRECTIONS)
    for offset in range(1, len(names)):
        other = with_other_direction(text, offset)
        scene = parse_caption(other)
        assert [o.direction for o in scene.objects] == [names[(names.index(d) + offset) % len(names)]
                                                         for d in ("left", "down-right")]
        assert [(o.color, o.shape, o.speed) for o in scene.objects] == [("red", "circle", "quickly"),
                                                                         ("orange", "square", "slowly")]
        assert scene.background == "gray"
    assert with_other_direction("a red circle moving left on a black background", 1) == \
        "a red circle moving right on a black background"
    assert with_other_direction("", 3) is None and with_other_direction("a cat moving sideways", 3) is None
    with pytest.raises(UserError, match="offset=8 must be an int in 1..7"):
        with_other_direction(text, 8)
