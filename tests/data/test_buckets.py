"""Aspect and frame buckets, and the batches dealt from them: one bucket per batch, every sample (times
its repeats) once per epoch, a function of (seed, epoch) alone."""

import math

import pytest

from slidefusion.data.buckets import (Bucket, BucketBatches, aspect_buckets, check_frame_buckets, format_bucket_table,
                                      frame_bucket, nearest_bucket, pixels_kept, target_area)
from slidefusion.core.errors import UserError


def test_aspect_buckets_fill_the_area_in_steps_of_the_stride():
    area = target_area([832, 480], 16, "data.resolution")
    buckets = aspect_buckets(area, 16)
    assert (480, 832) in buckets and (832, 480) in buckets
    for h, w in buckets:
        assert h % 16 == 0 and w % 16 == 0 and h * w <= area and max(h / w, w / h) <= 4
        assert (h + 16) * w > area  # the tallest that fits at this width
    assert target_area(512, 16, "data.resolution") == 512 * 512


def test_each_clip_goes_to_the_bucket_nearest_its_aspect_ratio():
    buckets = aspect_buckets(832 * 480, 16)
    landscape = nearest_bucket(1080, 1920, buckets)
    assert abs(landscape[1] / landscape[0] - 16 / 9) < 0.05
    portrait = nearest_bucket(1920, 1080, buckets)
    assert portrait[0] > portrait[1] and abs(portrait[0] / portrait[1] - 16 / 9) < 0.05
    square = nearest_bucket(500, 500, buckets)
    assert abs(square[0] / square[1] - 1) < 0.03  # 632 x 632 is the area, but 632 is not a multiple of 16
    # a 9:16 portrait video in its own bucket keeps nearly all of its picture; centre-cropped to
    # 832x480 (landscape) it keeps a third
    assert pixels_kept(1920, 1080, *portrait) > 0.97
    assert pixels_kept(1920, 1080, 480, 832) == pytest.approx((1080 * 480 / 832) / 1920, rel=1e-6)


def test_a_clip_fills_the_largest_frame_bucket_it_can():
    assert frame_bucket(40, [1, 17, 33, 81]) == 33
    assert frame_bucket(17, [1, 17, 33]) == 17 and frame_bucket(16, [17, 33]) is None and frame_bucket(1, [1, 5]) == 1
    assert check_frame_buckets([33, 1, 17, 17], 4) == [1, 17, 33]
    for bad in ([8], [0], [1, 18]):
        with pytest.raises(UserError, match="is not allowed by this VAE; valid: 1 \\+ 4k"):
            check_frame_buckets(bad, 4)
    with pytest.raises(UserError, match="at least one"):
        check_frame_buckets([], 4)


@pytest.mark.parametrize("resolution", [500, [832, 470], [0, 16], [16, 16, 16]])
def test_a_resolution_off_the_stride_is_refused(resolution):
    with pytest.raises(UserError, match="data.resolution"):
        target_area(resolution, 16, "data.resolution")


def _samples():
    buckets = [Bucket(9, 48, 80)] * 5 + [Bucket(1, 64, 48)] * 3 + [Bucket(5, 80, 48)] * 1
    repeats = [1, 1, 2, 1, 1, 1, 3, 1, 1]
    return buckets, repeats


def test_batches_are_one_bucket_each_and_cover_the_epoch_exactly():
    buckets, repeats = _samples()
    batches = BucketBatches(buckets, repeats, batch_size=2, seed=7)
    assert batches.per_epoch == math.ceil(6 / 2) + math.ceil(5 / 2) + 1
    for epoch in range(3):
        dealt = batches.epoch(epoch)
        assert len(dealt) == batches.per_epoch
        assert all(len({buckets[i] for i in batch}) == 1 and 1 <= len(batch) <= 2 for batch in dealt)
        counts = [sum(batch.count(i) for batch in dealt) for i in range(len(buckets))]
        assert counts == repeats
    assert batches.epoch(0) != batches.epoch(1)  # reshuffled every epoch
    table = format_bucket_table(batches)
    assert "9x48x80" in table and "1x64x48" in table and f"{batches.per_epoch} steps per epoch" in table


def test_batch_k_is_a_function_of_seed_and_k_alone():
    buckets, repeats = _samples()
    first = BucketBatches(buckets, repeats, 2, seed=3)
    straight = [first.batch(k) for k in range(2 * first.per_epoch + 1)]
    fresh = BucketBatches(buckets, repeats, 2, seed=3)  # a resumed run: nothing cached, starts mid-epoch
    assert [fresh.batch(k) for k in range(first.per_epoch - 1, len(straight))] == straight[first.per_epoch - 1:]
    assert BucketBatches(buckets, repeats, 2, seed=4).epoch(0) != first.epoch(0)
