import numpy as np
import pytest
import torch

from slidefusion.data.shapes import MovingShapes
from slidefusion.data.video_io import from_uint8, read_video, to_uint8, upscale_factor, write_video
from slidefusion.core.errors import UserError


def _color_blocks(frames: int, height: int, width: int) -> np.ndarray:
    """(T, H, W, 3) uint8: left half red, right half blue, brightness ramping over time."""
    video = np.zeros((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        video[t, :, : width // 2] = (200, 30 + 10 * t, 30)
        video[t, :, width // 2 :] = (30, 30 + 10 * t, 200)
    return video


def test_to_uint8_converts_both_layouts():
    x = torch.tensor([-1.0, 0.0, 1.0, 2.0, float("nan")]).view(1, 5, 1, 1).expand(3, 5, 1, 1)
    out = to_uint8(x)
    assert out.shape == (5, 1, 1, 3) and out.dtype == np.uint8
    assert out[:, 0, 0, 0].tolist() == [0, 128, 255, 255, 128]  # clamped; NaN -> mid-grey
    video = _color_blocks(2, 4, 6)
    assert np.array_equal(to_uint8(video), video)
    assert np.array_equal(to_uint8(from_uint8(video)), video)  # exact round trip
    with pytest.raises(UserError, match="video"):
        to_uint8(torch.zeros(4, 2, 3, 3))


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
@pytest.mark.parametrize("size", [(32, 32), (17, 19)])
def test_round_trip_keeps_frames_and_colors(tmp_path, suffix, size):
    video = _color_blocks(6, *size)
    path = write_video(tmp_path / f"clip{suffix}", video, fps=8, upscale=1)
    back = read_video(path)
    assert back.shape[0] == 6 and back.dtype == np.uint8
    # mp4 pads odd sizes to even by repeating the edge; the original area comes back first.
    even = tuple(s + s % 2 for s in size) if suffix == ".mp4" else size
    assert back.shape[1:3] == even
    back = back[:, : size[0], : size[1]].astype(np.float64)
    # Lossy codec: compare mean colour away from the red/blue border, with a tolerance.
    w = size[1]
    for t in (0, 5):
        left, right = back[t, :, : w // 2 - 2].mean(axis=(0, 1)), back[t, :, w // 2 + 2 :].mean(axis=(0, 1))
        assert np.abs(left - video[t, 0, 0]).max() < 16
        assert np.abs(right - video[t, 0, -1]).max() < 16


def test_default_upscale_makes_small_videos_visible(tmp_path):
    video = MovingShapes(1, 3, 32, 48, seed=0)[0]["video"]
    assert upscale_factor(32, 48) == 8
    back = read_video(write_video(tmp_path / "s.mp4", video))
    assert back.shape == (3, 256, 384, 3)
    tiny = read_video(write_video(tmp_path / "t.mp4", np.zeros((2, 1, 1, 3), np.uint8)))
    assert tiny.shape == (2, 256, 256, 3)


def test_gif_keeps_runs_of_identical_frames(tmp_path):
    # Pillow stores a run of identical frames as one long frame; reading must restore the count.
    video = np.zeros((7, 8, 8, 3), np.uint8)
    video[3:] = 200
    assert read_video(write_video(tmp_path / "runs.gif", video, upscale=1)).shape[0] == 7
    assert read_video(write_video(tmp_path / "still.gif", video[:4], upscale=1)).shape[0] == 4


def test_read_first_frames_only(tmp_path):
    video = _color_blocks(6, 8, 8)
    for suffix in (".mp4", ".gif"):
        assert read_video(write_video(tmp_path / f"v{suffix}", video, upscale=1), frames=4).shape[0] == 4


def test_write_is_atomic_and_creates_folders(tmp_path, monkeypatch):
    out = tmp_path / "a" / "b" / "clip.gif"
    write_video(out, _color_blocks(2, 8, 8), upscale=1)
    assert sorted(p.name for p in out.parent.iterdir()) == ["clip.gif"]  # no temp file left

    import slidefusion.data.video_io as video_io

    def crash(path, frames, fps):
        path.write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setitem(video_io._WRITERS, ".gif", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        write_video(out, _color_blocks(2, 8, 8), upscale=1)
    assert sorted(p.name for p in out.parent.iterdir()) == ["clip.gif"]  # old file intact, no temp
    assert read_video(out).shape[0] == 2


def test_unknown_suffix_is_user_error(tmp_path):
    with pytest.raises(UserError, match=r"out must end in \.mp4 or \.gif"):
        write_video(tmp_path / "clip.avi", _color_blocks(1, 4, 4))
    with pytest.raises(UserError, match="fps"):
        write_video(tmp_path / "clip.gif", _color_blocks(1, 4, 4), fps=0)


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_corrupt_or_missing_file_is_one_line_user_error(tmp_path, suffix):
    bad = tmp_path / f"bad{suffix}"
    bad.write_bytes(b"not a video" * 50)
    with pytest.raises(UserError, match=f"cannot read video {bad}") as info:
        read_video(bad)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="cannot read video .*missing.mp4: no such file"):
        read_video(tmp_path / "missing.mp4")
