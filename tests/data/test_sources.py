"""Datasets of real files: every supported type read, the skip table (found / used / skipped per
reason), data.strict, frame extraction (head, chunk, slide, uniform, fps), and the clips' buckets."""

import numpy as np
import pytest
import torch

from slidefusion.data import frames as extraction
from slidefusion.data.buckets import Bucket
from slidefusion.data.media import probe, read_windows
from slidefusion.data.sources import (NO_CAPTION, TOO_SHORT, TOO_SLOW, UNREADABLE, UNSUPPORTED, BAD_CAPTION, Rules,
                                      SourceConfig, format_table, scan)
from slidefusion.core.errors import UserError
from slidefusion.testing.media import make_folder, ramp, write_media

# name, frames, height, width: every supported suffix, landscape and portrait, stills and short clips
MIXED = [("clip1.mp4", 9, 48, 80), ("still.png", 1, 64, 48), ("phone.mov", 13, 80, 48), ("screen.mkv", 9, 48, 96),
         ("short.webm", 3, 48, 48), ("anim.gif", 5, 32, 32), ("w.webp", 1, 40, 40), ("j.jpg", 1, 48, 64),
         ("sub/a.avi", 9, 48, 64), ("photo.jpeg", 1, 32, 64)]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """MIXED, captioned, plus a clip without a caption, an empty caption, a caption that is not
    UTF-8, a damaged mp4 and a file of an unsupported type."""
    root = make_folder(tmp_path_factory.mktemp("mixed"), MIXED)
    (root / "nocap.mp4").write_bytes((root / "clip1.mp4").read_bytes())
    (root / "empty.png").write_bytes((root / "still.png").read_bytes())
    (root / "empty.txt").write_text("  \n")
    (root / "latin.png").write_bytes((root / "still.png").read_bytes())
    (root / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "bad.mp4").write_bytes(b"not a video at all")
    (root / "bad.txt").write_text("a damaged clip")
    (root / "notes.md").write_text("not media")
    (root / ".hidden.mp4").write_bytes(b"a writer's temporary file")
    return root


def _rules(frames=(1, 5, 9), area=80 * 48):
    return Rules(tuple(frames), (48, 80), area, 16)


def test_every_supported_type_is_probed_and_read(mixed):
    for name, frames, height, width in MIXED:
        info = probe(mixed / name)
        assert (info.frames, info.height, info.width) == (frames, height, width), name
        assert (info.fps is None) == (frames == 1 and name.endswith((".png", ".jpg", ".jpeg", ".webp"))), name
        if frames > 1:
            assert info.fps == pytest.approx(16, rel=0.05), name
    [(number, video)] = read_windows(mixed / "phone.mov", [[2, 5, 8]])
    assert number == 0 and video.shape == (3, 80, 48, 3)
    expected = ramp(13, 80, 48, seed=2)[[2, 5, 8]]  # phone.mov is MIXED[2]; the blue channel moves 20 per frame
    assert np.allclose(video[:, 10, 10, 2].astype(float), expected[:, 10, 10, 2], atol=6)


def test_windows_come_from_one_decode_in_order_of_their_ends(mixed):
    got = list(read_windows(mixed / "clip1.mp4", [[4, 5, 6, 7, 8], [0, 1, 2, 3, 4]]))
    assert [n for n, _ in got] == [1, 0] and all(v.shape == (5, 48, 80, 3) for _, v in got)
    with pytest.raises(UserError, match="ended after 9 frames"):
        list(read_windows(mixed / "clip1.mp4", [[0, 9]]))


def test_a_damaged_file_is_a_one_line_user_error(mixed):
    with pytest.raises(UserError, match=r"cannot read .*bad.mp4"):
        probe(mixed / "bad.mp4")
    with pytest.raises(UserError, match="unsupported type .md"):
        probe(mixed / "notes.md")


def test_the_skip_table_counts_every_file_with_its_reason(mixed):
    clips, [report] = scan([(SourceConfig(root=str(mixed)), "data")], _rules(frames=(5, 9)), strict=False)
    skipped = {reason: sorted(names) for reason, names in report.skipped.items()}
    assert skipped[NO_CAPTION] == ["empty.png (empty)", "nocap.mp4"]
    assert skipped[BAD_CAPTION] == ["latin.png"] and skipped[UNSUPPORTED] == ["notes.md"]
    assert [n.split(" ")[0] for n in skipped[UNREADABLE]] == ["bad.mp4"]
    # with buckets of 5 and 9 frames, stills and the 3-frame clip fill none
    assert sorted(n.split(" ")[0] for n in skipped[TOO_SHORT]) == ["j.jpg", "photo.jpeg", "short.webm", "still.png", "w.webp"]
    assert report.found == len(MIXED) + 5 and report.used == 5 == len(clips)  # .hidden.mp4 is not found at all
    assert report.found == report.used + sum(len(v) for v in report.skipped.values())
    table = format_table([report])
    for header in ("found", "used", "no caption", "unreadable", "too short", "unsupported type", "caption not UTF-8"):
        assert header in table.splitlines()[0]
    assert "bad.mp4" in table and "nocap.mp4" in table


def test_strict_turns_any_skip_into_one_line(mixed):
    with pytest.raises(UserError) as error:
        scan([(SourceConfig(root=str(mixed)), "data")], _rules(), strict=True)
    assert "data.strict=true" in str(error.value) and "\n" not in str(error.value)


def test_a_source_without_usable_files_and_an_empty_folder_are_errors(tmp_path, mixed):
    make_folder(tmp_path / "uncaptioned", [("a.mp4", 5, 32, 32)], captions=False)
    (tmp_path / "empty").mkdir()
    sources = [(SourceConfig(root=str(mixed)), "data.datasets[0]"),
               (SourceConfig(root=str(tmp_path / "uncaptioned")), "data.datasets[1]")]
    with pytest.raises(UserError, match=r"data.datasets\[1\].root=.*none of its 1 files is usable \(1 no caption\)"):
        scan(sources, _rules(), strict=False)
    with pytest.raises(UserError, match="holds no image or video files"):
        scan([(SourceConfig(root=str(tmp_path / "empty")), "data")], _rules(), strict=False)
    with pytest.raises(UserError, match=r"data.root: no such folder"):
        scan([(SourceConfig(root=str(tmp_path / "nowhere")), "data")], _rules(), strict=False)


def test_clips_go_to_the_nearest_aspect_and_the_largest_frame_bucket_unpadded(mixed):
    clips, _ = scan([(SourceConfig(root=str(mixed)), "data")], _rules(frames=(1, 5, 9)), strict=False)
    by_name = {c.path.name: c.bucket for c in clips.clips}
    assert by_name["clip1.mp4"] == Bucket(9, 48, 80)  # 5:3 landscape
    assert by_name["phone.mov"] == Bucket(9, 80, 48)  # 13 frames fill 9, not padded to a longer one
    assert by_name["short.webm"] == Bucket(1, 48, 48) or by_name["short.webm"].frames == 1
    assert by_name["anim.gif"].frames == 5 and by_name["still.png"].frames == 1
    assert by_name["screen.mkv"].width > by_name["screen.mkv"].height  # 2:1 stays landscape
    for bucket in by_name.values():
        assert bucket.height % 16 == 0 and bucket.width % 16 == 0 and bucket.height * bucket.width <= 80 * 48
    index = [c.path.name for c in clips.clips].index("phone.mov")
    item = clips[index]
    assert item["video"].shape == (3, 9, 80, 48) and item["video"].dtype == torch.float32
    assert item["caption"] == "clip 2"


def test_frame_extraction_modes_and_fps(tmp_path):
    line = extraction.timeline(20, 30.0, 15.0)  # 30 fps read at 15: every other frame
    assert line.tolist() == list(range(0, 20, 2))
    assert extraction.timeline(20, 10.0, 15.0) is None  # never repeats frames
    assert extraction.timeline(20, None, 15.0).tolist() == list(range(20))  # no rate stated: frame by frame
    assert extraction.timeline(10, None, None, step=3).tolist() == [0, 3, 6, 9]
    assert extraction.starts(10, 4, "head") == [0]
    assert extraction.starts(10, 4, "chunk") == [0, 4]
    assert extraction.starts(10, 4, "slide", stride=3) == [0, 3, 6]
    assert extraction.starts(10, 4, "uniform", count=3) == [0, 3, 6]
    assert extraction.starts(3, 4, "head") == []
    root = make_folder(tmp_path, [("long.mp4", 21, 32, 48)])
    source = SourceConfig(root=str(root), frames="slide", stride=4, repeats=3)
    clips, [report] = scan([(source, "data")], _rules(frames=(9,)), strict=False)
    assert [c.frames for c in clips.clips] == [list(range(s, s + 9)) for s in (0, 4, 8, 12)]
    assert report.used == 1 and report.clips == 4 and clips.repeats == [3] * 4
    slow = SourceConfig(root=str(root), fps=32)
    with pytest.raises(UserError, match="none of its 1 files is usable"):
        scan([(slow, "data")], _rules(frames=(9,)), strict=False)
    _, [report] = scan([(SourceConfig(root=str(root), fps=8), "data")], _rules(frames=(9,)), strict=False)
    assert report.used == 1  # 21 frames at 16 fps read at 8: 11 frames, one clip of 9


def test_a_fixed_resolution_source_keeps_its_size(tmp_path):
    root = make_folder(tmp_path, [("a.mp4", 5, 48, 80), ("b.png", 1, 64, 64)])
    clips, _ = scan([(SourceConfig(root=str(root), resolution=[32, 48]), "data")], _rules(), strict=False)
    assert {c.bucket for c in clips.clips} == {Bucket(5, 48, 32), Bucket(1, 48, 32)}


def test_the_source_keys_are_checked():
    for kwargs, needle in [({"repeats": 0}, "repeats=0"), ({"frames": "middle"}, "frames='middle' is unknown"),
                           ({"frames": "slide", "stride": 0}, "stride=0"), ({"caption_extension": "txt"}, "look like .txt"),
                           ({"caption_extension": ".mp4"}, "is a media type"), ({"fps": 0.0}, "fps=0.0"),
                           ({"fps": 8.0, "frame_step": 2}, "exclude each other"), ({"resolution": [32]}, "[width, height]")]:
        with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("(", r"\(")):
            SourceConfig(root="x", **kwargs).check("data.datasets[0]")


def test_ramp_is_what_the_reader_sees(tmp_path):
    path = write_media(tmp_path / "r.png", 1, 8, 12)
    [(_, video)] = read_windows(path, [[0]])
    assert np.array_equal(video[0], ramp(1, 8, 12)[0])
