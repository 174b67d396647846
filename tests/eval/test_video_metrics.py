import numpy as np
import pytest
import torch

from slidefusion.data.shapes import ShapeObject, ShapeScene, render
from slidefusion.data.video_io import from_uint8
from slidefusion.core.errors import UserError
from slidefusion.eval.video_metrics import (
    _consistent,
    motion_smoothness,
    optical_flow,
    temporal_flickering,
    video_metrics,
    warp,
    warping_error,
)

FRAMES, SIZE = 12, 32
# A fixed shuffle of 12 frames in which no frame keeps a neighbour it had in the smooth video.
SHUFFLE = [5, 0, 9, 3, 11, 7, 1, 10, 4, 8, 2, 6]


def _smooth_video() -> np.ndarray:
    """Two shapes in straight-line motion (one fast, one slow): uint8 (12, 32, 32, 3)."""
    objects = (
        ShapeObject("red", "circle", "right", "quickly", 0.15, 0.7, 0.2),
        ShapeObject("cyan", "square", "down-left", "slowly", 0.12, 0.25, 0.7),
    )
    return render(ShapeScene(objects, "gray"), FRAMES, SIZE, SIZE)


def _noisy(video: np.ndarray, sigma: float = 60.0) -> np.ndarray:
    noise = np.random.default_rng(0).normal(0.0, sigma, video.shape)
    return np.clip(video + noise, 0, 255).astype(np.uint8)


def _textured_disc(cy: float, cx: float, size: int = SIZE, radius: float = 9.0) -> np.ndarray:
    """uint8 (size, size, 3): a disc with a fixed sinusoidal texture (moving with the disc) on a flat
    background, antialiased by 4x4 supersampling, so any subpixel centre renders faithfully."""
    offsets = (np.arange(4) + 0.5) / 4
    ys = np.arange(size)[:, None, None, None] + offsets[None, None, :, None]  # (H, 1, 4, 1)
    xs = np.arange(size)[None, :, None, None] + offsets[None, None, None, :]  # (1, W, 1, 4)
    dy, dx = ys - cy, xs - cx
    texture = 140 + 70 * np.sin(0.9 * dx) * np.cos(0.7 * dy)
    image = np.where(dy**2 + dx**2 <= radius**2, texture, 30.0).mean(axis=(2, 3))
    return np.repeat(np.rint(image).astype(np.uint8)[..., None], 3, axis=-1)


# --- temporal flickering -----------------------------------------------------------------------


def test_flickering_matches_a_hand_computation():
    video = np.random.default_rng(1).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    maes = [np.mean(np.abs(video[t].astype(np.float64) - video[t + 1])) for t in range(5)]
    assert temporal_flickering(video) == pytest.approx((255 - np.mean(maes)) / 255, rel=1e-12)


def test_static_video_is_perfect():
    video = np.repeat(_smooth_video()[:1], 6, axis=0)
    assert temporal_flickering(video) == 1.0
    assert motion_smoothness(video) == 1.0
    assert warping_error(video) == 0.0


def test_brightness_flicker_lowers_the_flickering_score():
    video = _smooth_video()
    offsets = np.where(np.arange(FRAMES) % 2 == 0, 25, -25)[:, None, None, None]
    flickering = np.clip(video.astype(np.int16) + offsets, 0, 255).astype(np.uint8)
    steady, flicker = temporal_flickering(video), temporal_flickering(flickering)
    assert flicker < steady - 0.05, (steady, flicker)


# --- optical flow and warping ------------------------------------------------------------------


@pytest.mark.parametrize("dy, dx", [(0.0, 1.5), (-0.75, 1.25), (1.0, 0.0)])
def test_optical_flow_recovers_a_subpixel_translation(dy, dx):
    cy = cx = SIZE / 2
    a, b = _textured_disc(cy, cx), _textured_disc(cy + dy, cx + dx)
    flow = optical_flow(a, b)
    assert flow.shape == (SIZE, SIZE, 2) and flow.dtype == np.float32
    # The disc's interior in frame a, away from its edge (where background and disc mix).
    ys, xs = np.mgrid[:SIZE, :SIZE] + 0.5
    inside = (ys - cy) ** 2 + (xs - cx) ** 2 < 7.0**2
    error = np.hypot(flow[..., 0] - dx, flow[..., 1] - dy)[inside]
    assert error.mean() < 0.1 and error.max() < 0.3, (error.mean(), error.max())


def test_optical_flow_of_identical_frames_is_zero():
    frame = _textured_disc(15.3, 16.8)
    assert not optical_flow(frame, frame.copy()).any()


def test_warp_samples_at_p_plus_flow():
    frame = np.random.default_rng(2).integers(0, 256, (8, 10, 3), dtype=np.uint8)
    flow = np.zeros((8, 10, 2), dtype=np.float32)
    flow[..., 0], flow[..., 1] = 2.0, -1.0  # output(y, x) = frame(y - 1, x + 2)
    out = warp(frame, flow)
    np.testing.assert_array_equal(out[1:, :-2], frame[:-1, 2:])
    np.testing.assert_array_equal(out[0, 0], frame[0, 2])  # y = -1 is clamped to the first row


def test_warp_with_estimated_flow_brings_the_next_frame_back():
    a, b = _textured_disc(16.0, 15.0), _textured_disc(16.5, 16.5)
    back = warp(b, optical_flow(a, b))
    before, after = np.abs(b.astype(float) - a).mean(), np.abs(back.astype(float) - a).mean()
    assert after < 0.25 * before, (before, after)


def test_forward_backward_consistency_follows_sundaram():
    def constant(dx: float) -> np.ndarray:
        flow = np.zeros((6, 6, 2), dtype=np.float32)
        flow[..., 0] = dx
        return flow

    assert _consistent(constant(2.0), constant(-2.0)).all()
    assert _consistent(constant(2.0), constant(-1.4)).all()  # off by 0.6 px: 0.36 < 0.5 + 0.0596
    assert not _consistent(constant(2.0), constant(0.0)).any()  # the way back is missing
    # Large motions may be off by more: 2 px is fine at 20 px (4 < 7.74), 3 px is not (9 < 7.39).
    assert _consistent(constant(20.0), constant(-18.0)).all()
    assert not _consistent(constant(20.0), constant(-17.0)).any()


# --- warping error and motion smoothness -------------------------------------------------------


def test_warping_error_is_lowest_for_smooth_motion():
    video = _smooth_video()
    smooth, shuffled = warping_error(video), warping_error(video[SHUFFLE])
    noisy = warping_error(_noisy(video))
    assert 0.0 < smooth < 0.5 * shuffled, (smooth, shuffled)
    assert smooth < 0.1 * noisy, (smooth, noisy)


def test_motion_smoothness_prefers_smooth_motion():
    video = _smooth_video()
    smooth, shuffled = motion_smoothness(video), motion_smoothness(video[SHUFFLE])
    assert smooth > 0.99 and smooth > shuffled + 0.02, (smooth, shuffled)
    # Interpolating by flow must beat simply averaging the neighbours of each odd frame.
    frames = video.astype(np.float64)
    blend_maes = [np.abs(np.rint((frames[t - 1] + frames[t + 1]) / 2) - frames[t]).mean()
                  for t in range(1, FRAMES - 1, 2)]
    blend_score = np.mean([(255 - mae) / 255 for mae in blend_maes])
    assert smooth > blend_score, (smooth, blend_score)


# --- inputs --------------------------------------------------------------------------------------


def test_tensor_and_uint8_inputs_give_the_same_numbers():
    video = _smooth_video()
    from_array, from_tensor = video_metrics(video), video_metrics(from_uint8(video))
    assert set(from_array) == {"temporal_flickering", "motion_smoothness", "warping_error"}
    assert from_array == from_tensor
    assert from_array["motion_smoothness"] == motion_smoothness(video)


@pytest.mark.parametrize(
    "video",
    [
        np.zeros((4, 8, 8), dtype=np.uint8),  # no channel axis
        np.zeros((4, 8, 8, 4), dtype=np.uint8),  # RGBA
        torch.zeros(4, 2, 8, 8),  # float whose first axis is not the 3 channels
        np.zeros((1, 8, 8, 3), dtype=np.uint8),  # one frame
        torch.zeros(3, 1, 8, 8),  # one frame, tensor form
    ],
)
@pytest.mark.parametrize("metric", [temporal_flickering, warping_error, motion_smoothness, video_metrics])
def test_bad_videos_raise_user_error_naming_video(metric, video):
    with pytest.raises(UserError, match="video"):
        metric(video)


def test_motion_smoothness_needs_three_frames():
    with pytest.raises(UserError, match="video must have at least 3 frames, got 2"):
        motion_smoothness(np.zeros((2, 8, 8, 3), dtype=np.uint8))
    assert warping_error(np.zeros((2, 8, 8, 3), dtype=np.uint8)) == 0.0


def test_bad_frames_raise_user_error_naming_the_parameter():
    frame = np.zeros((8, 8, 3), dtype=np.uint8)
    with pytest.raises(UserError, match="^b must"):
        optical_flow(frame, frame.astype(np.float32))
    with pytest.raises(UserError, match="a and b must have the same"):
        optical_flow(frame, np.zeros((8, 9, 3), dtype=np.uint8))
    with pytest.raises(UserError, match="^flow must"):
        warp(frame, np.zeros((8, 8), dtype=np.float32))

