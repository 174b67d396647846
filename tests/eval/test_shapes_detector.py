"""The moving-shapes detector (slidefusion.eval.shapes_detector) on ground truth and on broken clips.

Ground truth must score as aligned; each corruption must lower the scores it is meant to catch.
Every rate test prints its rates (run with -s to see them).
"""

import dataclasses
import functools
import time

import numpy as np
import pytest

from slidefusion.data.shapes import (
    COLORS,
    DIRECTIONS,
    SPEEDS,
    MovingShapes,
    caption,
    object_centers,
    radius_px,
    render,
)
from slidefusion.data.video_io import from_uint8, read_video, write_video
from slidefusion.core.errors import UserError
from slidefusion.eval.shapes_detector import detect, score, summarize

SIDE = 32
CLIPS = 64


@functools.lru_cache(maxsize=None)
def _clips(frames: int, max_objects: int = 1, side: int = SIDE):
    """(scenes, uint8 videos, captions) of the first CLIPS items of the reference dataset."""
    data = MovingShapes(CLIPS, frames, side, side, seed=123, max_objects=max_objects)
    scenes = [data.scene(i) for i in range(CLIPS)]
    return scenes, [render(s, frames, side, side) for s in scenes], [caption(s) for s in scenes]


def _rates(videos, prompts, label: str) -> dict[str, float]:
    start = time.process_time()
    rates = summarize([score(v, p) for v, p in zip(videos, prompts)])
    per_video = (time.process_time() - start) / len(videos)
    shown = ", ".join(f"{k}={v:.3f}" for k, v in rates.items() if k != "count")
    print(f"\n{label}: {shown} ({per_video * 1000:.0f} ms CPU per video)")
    return rates


# --- ground truth -------------------------------------------------------------------------------


@pytest.mark.parametrize("frames", [8, 32])
def test_ground_truth_single_object_is_aligned(frames):
    _, videos, prompts = _clips(frames)
    rates = _rates(videos, prompts, f"ground truth, 1 object, {frames} frames")
    assert rates["aligned"] >= 0.95
    assert rates["speed_ok"] >= 0.95
    assert rates["heading_ok"] >= 0.95
    assert rates["consistency"] >= 0.95


def test_ground_truth_two_objects_is_aligned():
    # Measured 0.969 (62 of 64): in one clip a circle hides under the square that moves with it, in
    # another a diamond is partly covered in every frame. Occlusion limits this rate.
    _, videos, prompts = _clips(8, max_objects=2)
    rates = _rates(videos, prompts, "ground truth, 2 objects, 8 frames")
    assert rates["aligned"] >= 0.93
    assert rates["consistency"] >= 0.9


def _through_mp4(videos: list[np.ndarray], folder, upscale: int | None) -> list[np.ndarray]:
    """The clips after one H.264 round trip, back at their own size (block means undo upscaling).

    All clips go into one file, one after the other, so the test pays for one encoder start.
    """
    frames = np.concatenate(videos)
    back = read_video(write_video(folder / "clips.mp4", frames, upscale=upscale))
    assert len(back) == len(frames)
    t, height, width = frames.shape[:3]
    factor = back.shape[1] // height
    assert back.shape[1:3] == (height * factor, width * factor)
    back = back.reshape(t, height, factor, width, factor, 3).mean((2, 4))
    return np.split(np.rint(back).astype(np.uint8), len(videos))


@pytest.mark.parametrize("upscale", [None, 1])
def test_ground_truth_survives_mp4(tmp_path, upscale):
    # upscale=None is what write_video does by default (8x here, so chroma keeps full resolution);
    # upscale=1 stores 32x32 as is, where yuv420p halves the chroma of 5-px objects (measured 0.97).
    _, videos, prompts = _clips(8)
    rates = _rates(_through_mp4(videos, tmp_path, upscale), prompts, f"mp4 (upscale={upscale}), 8 frames")
    assert rates["aligned"] >= 0.9
    assert rates["direction_ok"] >= 0.95


# --- corrupted clips ----------------------------------------------------------------------------


def test_wrong_colour_fails_colour_and_alignment():
    scenes, _, prompts = _clips(8)
    names = list(COLORS)
    wrong = []
    for scene in scenes:  # the same clip with the object painted in the next palette colour
        obj = scene.objects[0]
        other = dataclasses.replace(obj, color=names[(names.index(obj.color) + 1) % len(names)])
        wrong.append(render(dataclasses.replace(scene, objects=(other,)), 8, SIDE, SIDE))
    rates = _rates(wrong, prompts, "wrong colour")
    assert rates["color_ok"] <= 0.05
    assert rates["aligned"] <= 0.05
    assert rates["consistency"] <= 0.2


def _reversed_direction(scene, frames: int) -> str:
    """The direction a time-reversed clip moves in at its first frame (the original's last).

    Per axis, the closed form of `object_centers` moves with the free-flight velocity while its
    phase within a bounce period is in the first half, against it in the second half.
    """
    obj = scene.objects[0]
    r, step = radius_px(obj, SIDE, SIDE), SPEEDS[obj.speed] * SIDE
    sign = []
    for start, d in zip((obj.start_y, obj.start_x), DIRECTIONS[obj.direction]):
        span = SIDE - 2 * r
        phase = np.mod(start * SIDE + d * step * (frames - 1) - r, 2 * span)
        sign.append(-np.sign(d) * (1 if 0 < phase <= span else -1))
    return next(name for name, v in DIRECTIONS.items() if tuple(np.sign(v)) == tuple(sign))


def test_reversed_motion_is_seen_as_the_opposite_direction():
    frames = 8
    scenes, videos, prompts = _clips(frames)
    reverse = [_reversed_direction(s, frames) for s in scenes]
    changed = [i for i, s in enumerate(scenes) if reverse[i] != s.objects[0].direction]
    assert len(changed) >= CLIPS // 2  # most clips do not bounce back to their own direction
    rates = _rates([videos[i][::-1] for i in changed], [prompts[i] for i in changed], "reversed in time")
    assert rates["direction_ok"] <= 0.1
    assert rates["heading_ok"] <= 0.1
    assert rates["aligned"] <= 0.1
    # The detector reads the reversed clip as moving the other way, not as noise.
    detected = [detect(videos[i][::-1], scenes[i].objects[0].color).direction for i in changed]
    assert np.mean([d == reverse[i] for d, i in zip(detected, changed)]) >= 0.9


def test_shuffled_frames_have_no_consistent_motion():
    frames = 8
    _, videos, prompts = _clips(frames)
    order = np.random.default_rng(0).permutation(frames)
    assert (order != np.arange(frames)).sum() >= frames - 2
    rates = _rates([v[order] for v in videos], prompts, "shuffled frames")
    assert rates["direction_ok"] <= 0.2
    assert rates["aligned"] <= 0.2
    assert rates["speed_ok"] <= 0.3


def test_heavy_noise_lowers_alignment_and_consistency():
    _, videos, prompts = _clips(8)
    rng = np.random.default_rng(1)
    noisy = [np.clip(v + rng.normal(0.0, 60.0, v.shape), 0, 255).astype(np.uint8) for v in videos]
    clean = _rates(videos, prompts, "clean")
    rates = _rates(noisy, prompts, "gaussian noise sigma 60")
    assert rates["aligned"] <= clean["aligned"] - 0.1
    assert rates["consistency"] <= clean["consistency"] - 0.07


def test_a_subject_that_changes_shape_and_size_is_inconsistent():
    scenes, videos, prompts = _clips(8)
    obj = scenes[0].objects[0]
    other = dataclasses.replace(obj, shape="triangle" if obj.shape != "triangle" else "square", size=0.08)
    changed = render(dataclasses.replace(scenes[0], objects=(other,)), 8, SIDE, SIDE)
    spliced = np.concatenate([videos[0][:4], changed[4:]])
    steady, broken = detect(videos[0], obj.color), detect(spliced, obj.color)
    assert steady.consistency_parts["shape"] == 1.0
    assert broken.consistency_parts["shape"] <= 0.5 + 1e-9
    assert broken.consistency_parts["size"] <= 0.8
    assert broken.consistency <= steady.consistency - 0.1
    assert score(spliced, prompts[0])["consistency"] == pytest.approx(broken.consistency)


# --- prompts ------------------------------------------------------------------------------------


def test_a_colour_missing_from_the_video_is_not_aligned():
    scenes, videos, _ = _clips(8)
    for scene, video in zip(scenes[:8], videos[:8]):
        obj = scene.objects[0]
        absent = next(c for c in COLORS if c != obj.color)
        result = score(video, f"a {absent} {obj.shape} moving {obj.direction} {obj.speed}")
        assert result["objects"][0]["present_fraction"] == 0.0
        assert result["color_ok"] is False and result["aligned"] is False
        assert result["consistency"] == 0.0


@pytest.mark.parametrize("prompt", [
    "",
    "a purple circle moving left",
    "a red blob moving left",
    "a red circle moving sideways",
    "a red circle moving left at once",
    "a red circle moving left on a pink background",
    "something else entirely",
])
def test_bad_prompts_raise_user_error(prompt):
    _, videos, _ = _clips(8)
    with pytest.raises(UserError):
        score(videos[0], prompt)


def test_unknown_colour_and_bad_video_raise_user_error():
    _, videos, _ = _clips(8)
    with pytest.raises(UserError, match="color"):
        detect(videos[0], "purple")
    with pytest.raises(UserError):
        detect(np.zeros((8, 32, 32), dtype=np.uint8), "red")


# --- measurements -------------------------------------------------------------------------------


def test_track_measures_position_size_and_motion_of_ground_truth():
    scenes, videos, _ = _clips(32)
    for scene, video in zip(scenes[:16], videos[:16]):
        obj = scene.objects[0]
        track = detect(from_uint8(video), obj.color)  # the float (3, T, H, W) form models produce
        truth = object_centers(obj, 32, SIDE, SIDE)
        assert track.present.all() and track.present_fraction == 1.0
        assert np.abs(track.centroid - truth).max() < 0.15
        assert track.radius_px == pytest.approx(radius_px(obj, SIDE, SIDE), rel=0.1)
        assert (track.shape, track.direction, track.speed) == (obj.shape, obj.direction, obj.speed)
        assert track.motion_residual < 0.2
        assert np.abs(track.path - truth).max() < 0.3
        assert set(track.frame_shapes) == {obj.shape}
        assert track.motion_errors[(obj.direction, obj.speed)] == track.motion_residual
        assert track.dominant_color() == obj.color and track.color_share() > 0.9


def test_speed_is_told_apart_and_optional():
    scenes, videos, _ = _clips(8)
    obj = scenes[0].objects[0]
    other = next(s for s in SPEEDS if s != obj.speed)
    without = score(videos[0], f"a {obj.color} {obj.shape} moving {obj.direction}")
    assert without["speed_ok"] is None and without["aligned"] is True
    wrong = score(videos[0], f"a {obj.color} {obj.shape} moving {obj.direction} {other}")
    assert wrong["speed_ok"] is False and wrong["aligned"] is True  # speed is not part of aligned


def test_summarize_counts_rates_and_skips_unstated_speeds():
    scenes, videos, prompts = _clips(8)
    obj = scenes[0].objects[0]
    results = [
        score(videos[0], prompts[0]),
        score(videos[0], f"a {obj.color} {obj.shape} moving {obj.direction}"),
        score(videos[1], prompts[0]),  # another clip: its colour or motion differ
    ]
    rates = summarize(results)
    assert rates["count"] == 3
    assert rates["aligned"] == pytest.approx(np.mean([r["aligned"] for r in results]))
    assert rates["speed_ok"] == pytest.approx(np.mean([results[0]["speed_ok"], results[2]["speed_ok"]]))
    assert rates["consistency"] == pytest.approx(np.mean([r["consistency"] for r in results]))
    with pytest.raises(UserError):
        summarize([])
