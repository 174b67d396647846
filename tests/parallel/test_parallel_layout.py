"""Layout maths with hash-coded positions: every element knows where it must land."""

import pytest
import torch

from slidefusion.parallel.layout import (FRAMES, POSITIONS, Split, chunk_shapes, local_slices, pack_chunk, shard,
                                         split_sizes, unpack_consumer_slice)
from slidefusion.families.records import GRID, ROWS
from slidefusion.parallel.tokens import Tokens


def coded(b=2, t=5, s=7, c=3) -> torch.Tensor:
    """x[b, t, s, c] = a unique integer that spells its own coordinates."""
    idx = torch.meshgrid(*(torch.arange(n) for n in (b, t, s, c)), indexing="ij")
    return (idx[0] * 1_000_000 + idx[1] * 10_000 + idx[2] * 10 + idx[3]).double()


def switch(x, world, a, b, np_, nc):
    """Run the sliced switch a -> b for `world` virtual ranks; returns each rank's consumer slices."""
    full = tuple(x.shape)
    a_split, b_split = Split(full[a], world), Split(full[b], world)
    inbox = {}  # (dest, p, c) -> list over sources of flat pieces
    for r in range(world):
        for p, piece in enumerate(local_slices(shard(x, a, a_split, r), a, np_)):
            for c in range(nc):
                buffer, numels = pack_chunk(piece, b, b_split, c, nc)
                for j, part in enumerate(buffer.split(numels)):
                    inbox.setdefault((j, p, c), []).append(part)
    out = {}
    for j in range(world):
        for c in range(nc):
            buffers = [torch.cat(inbox[(j, p, c)]) for p in range(np_)]
            shapes = [chunk_shapes(full, a, a_split, np_, p, b, b_split, j, nc, c) for p in range(np_)]
            out[j, c] = unpack_consumer_slice(buffers, shapes, a)
    return out


def test_split_sizes_are_contiguous_and_uneven():
    assert split_sizes(7, 3) == [3, 2, 2] and split_sizes(2, 4) == [1, 1, 0, 0] and sum(split_sizes(15, 4)) == 15
    split = Split(10, 3)
    assert [split.range(i) for i in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert split.sub(0, 3) == [(0, 2), (2, 1), (3, 1)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("np_, nc", [(1, 1), (1, 3), (2, 1), (3, 2)])
@pytest.mark.parametrize("a, b", [(POSITIONS, FRAMES), (FRAMES, POSITIONS)])
def test_switch_delivers_every_element_to_its_place(world, np_, nc, a, b):
    x = coded(t=5, s=7)  # 5 and 7 split unevenly; with 5 ranks some slices are empty
    out = switch(x, world, a, b, np_, nc)
    for j in range(world):
        mine = shard(x, b, Split(x.shape[b], world), j)
        assert torch.equal(torch.cat([out[j, c] for c in range(nc)], dim=b), mine)
        for c, expected in enumerate(local_slices(mine, b, nc)):
            assert torch.equal(out[j, c], expected)  # each consumer slice alone is already right


@pytest.mark.parametrize("world", [2, 3, 4])
def test_round_trip_positions_frames_positions(world):
    x = coded(t=3, s=10)  # T < world for world=4: a rank holds no frame
    there = switch(x, world, POSITIONS, FRAMES, 2, 3)
    frames = [torch.cat([there[j, c] for c in range(3)], dim=FRAMES) for j in range(world)]
    back = switch(torch.cat(frames, dim=FRAMES), world, FRAMES, POSITIONS, 3, 2)
    for j in range(world):
        assert torch.equal(torch.cat([back[j, c] for c in range(2)], dim=POSITIONS),
                           shard(x, POSITIONS, Split(10, world), j))


def test_sliced_equals_monolithic():
    x = coded(t=6, s=9)
    mono = switch(x, 3, POSITIONS, FRAMES, 1, 1)
    sliced = switch(x, 3, POSITIONS, FRAMES, 3, 2)
    for j in range(3):
        assert torch.equal(mono[j, 0], torch.cat([sliced[j, 0], sliced[j, 1]], dim=FRAMES))


@pytest.mark.parametrize("layout", [GRID, ROWS])
@pytest.mark.parametrize("keep_frames", [True, False])
def test_token_views_put_every_token_where_it_belongs(layout, keep_frames):
    b, (t, h, w), c = 2, (3, 2, 5), 4
    tokens = Tokens((t, h, w), b, keep_frames, layout, ranks=3, rank=1)
    coded_grid = coded(b=b, t=t, s=h * w, c=c)  # (B, T, S, C), every value spells (b, t, s, c)
    kind = "spatial" if keep_frames else "full"
    canonical = coded_grid if keep_frames else coded_grid.reshape(b, 1, t * h * w, c)
    if layout == GRID:
        whole = coded_grid.reshape(b, t, h, w, c)
    else:
        whole = canonical.reshape(b * canonical.shape[1], -1, c)
    assert torch.equal(tokens.canonical(whole, kind), canonical)
    start, count = tokens.span
    mine = tokens.shard(whole, kind)
    assert torch.equal(tokens.canonical(mine, kind), canonical.narrow(2, start, count))
    if keep_frames:  # a temporal block's view of this rank's positions, and back
        temporal = tokens.block_input(canonical.narrow(2, start, count), "temporal", whole_frames=False)
        assert torch.equal(tokens.canonical(temporal, "temporal"), canonical.narrow(2, start, count))
    rows = torch.arange(b * 7).view(b * 7, 1).double()  # one row per (sample, position) of 7
    assert tokens.cut_rows(rows, 2, 3).flatten().tolist() == [2, 3, 4, 9, 10, 11]
