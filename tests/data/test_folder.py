import json

import numpy as np
import pytest
import torch

from slidefusion.data import VideoFolder, build_dataset
from slidefusion.data.folder import frame_indices, resize_center_crop
from slidefusion.data.video_io import write_video
from slidefusion.core.errors import UserError


def _ramp(frames: int, height: int, width: int, color) -> np.ndarray:
    """(T, H, W, 3) uint8 of one colour whose green channel encodes the frame number."""
    video = np.zeros((frames, height, width, 3), dtype=np.uint8)
    video[..., 0], video[..., 2] = color[0], color[2]
    video[..., 1] = (20 * np.arange(frames))[:, None, None]
    return video


@pytest.fixture
def folder(tmp_path):
    """Two clips (mp4 red 24x32, gif blue 16x16) with captions.csv."""
    write_video(tmp_path / "red.mp4", _ramp(6, 24, 32, (220, 0, 20)), upscale=1)
    write_video(tmp_path / "sub" / "blue.gif", _ramp(3, 16, 16, (20, 0, 220)), upscale=1)
    rows = ['file,caption', 'red.mp4,"a red clip, wide"', "sub/blue.gif,a blue clip"]
    (tmp_path / "captions.csv").write_text("\n".join(rows) + "\n")
    return tmp_path


def test_items_have_requested_shape_and_captions(folder):
    ds = VideoFolder(folder, frames=4, height=8, width=12)
    assert len(ds) == 2
    items = [ds[i] for i in range(2)]
    assert [it["caption"] for it in items] == ["a red clip, wide", "a blue clip"]
    for it in items:
        assert it["video"].shape == (3, 4, 8, 12) and it["video"].dtype == torch.float32
        assert it["video"].min() >= -1 and it["video"].max() <= 1
    red, blue = (it["video"].mean(dim=(1, 2, 3)) for it in items)  # mean (r, g, b) in [-1, 1]
    assert red[0] > 0.5 and red[2] < -0.5
    assert blue[2] > 0.5 and blue[0] < -0.5


def test_stride_and_short_clips_repeat_last_frame(folder):
    green = lambda item: ((item["video"][1].mean(dim=(1, 2)) + 1) * 127.5).numpy()  # noqa: E731
    # red.mp4 has 6 frames with green = 0, 20, ..., 100; stride 2 gives 0, 40, 80, then the last.
    frames = green(VideoFolder(folder, frames=4, height=8, width=8, stride=2)[0])
    assert np.allclose(frames, [0, 40, 80, 100], atol=8)
    # blue.gif has 3 frames: the fourth and fifth repeat the last one.
    frames = green(VideoFolder(folder, frames=5, height=8, width=8)[1])
    assert np.allclose(frames, [0, 20, 40, 40, 40], atol=3)


def test_hidden_files_are_skipped(folder):
    # write_video's temporary files are hidden: a crashed writer must not leave a readable "video".
    (folder / ".red.123.abcd.tmp.mp4").write_bytes(b"half-written")
    assert [p.name for p in VideoFolder(folder, 2, 8, 8).files] == ["red.mp4", "blue.gif"]


def test_frame_indices_and_center_crop():
    assert frame_indices(10, 4, 3).tolist() == [0, 3, 6, 9]
    assert frame_indices(5, 4, 2).tolist() == [0, 2, 4, 4]
    # Columns 0..9 of a 2x10 image: covering 2x4 needs no scaling, the crop keeps columns 3..6.
    x = torch.arange(10.0).expand(1, 1, 2, 10)
    assert resize_center_crop(x, 2, 4)[0, 0, 0].tolist() == [3, 4, 5, 6]
    assert resize_center_crop(torch.zeros(2, 3, 5, 7), 9, 4).shape == (2, 3, 9, 4)


def test_jsonl_and_sidecar_captions(tmp_path):
    write_video(tmp_path / "a.gif", _ramp(2, 8, 8, (200, 0, 0)), upscale=1)
    write_video(tmp_path / "b.gif", _ramp(2, 8, 8, (0, 0, 200)), upscale=1)
    (tmp_path / "captions.jsonl").write_text(json.dumps({"file": "a.gif", "caption": "from jsonl"}) + "\n\n")
    (tmp_path / "b.txt").write_text("from sidecar\n")
    assert VideoFolder(tmp_path, 2, 8, 8).captions == ["from jsonl", "from sidecar"]
    assert build_dataset("folder", root=tmp_path, frames=2, height=8, width=8).captions[1] == "from sidecar"


def test_missing_caption_names_the_video(folder):
    write_video(folder / "green.gif", _ramp(2, 8, 8, (0, 0, 0)), upscale=1)
    with pytest.raises(UserError, match="no caption for video .*green.gif"):
        VideoFolder(folder, 2, 8, 8)


def test_bad_folders_and_tables(tmp_path):
    with pytest.raises(UserError, match="root: no such folder"):
        VideoFolder(tmp_path / "nope", 2, 8, 8)
    with pytest.raises(UserError, match="root: no videos"):
        VideoFolder(tmp_path, 2, 8, 8)
    write_video(tmp_path / "a.gif", _ramp(2, 8, 8, (200, 0, 0)), upscale=1)
    (tmp_path / "captions.csv").write_text("name,text\na.gif,hello\n")
    with pytest.raises(UserError, match="columns file,caption"):
        VideoFolder(tmp_path, 2, 8, 8)
    (tmp_path / "captions.csv").unlink()
    (tmp_path / "captions.jsonl").write_text('{"file": "a.gif"}\n')
    with pytest.raises(UserError, match="captions.jsonl line 1"):
        VideoFolder(tmp_path, 2, 8, 8)
    with pytest.raises(UserError, match="stride must be an int >= 1, got 0"):
        VideoFolder(tmp_path, 2, 8, 8, stride=0)


def test_corrupt_video_fails_when_read(folder):
    (folder / "broken.mp4").write_bytes(b"junk" * 100)
    (folder / "broken.txt").write_text("broken clip")
    ds = VideoFolder(folder, 2, 8, 8)
    with pytest.raises(UserError, match="cannot read video .*broken.mp4"):
        ds[0]
