import itertools
import random

import pytest

from weightsync.layout.regions import Region, format_regions, subtract, uncovered


def cells(regions):
    out = set()
    for r in regions:
        out |= set(itertools.product(*[range(o, o + s) for o, s in zip(r.offsets, r.sizes)]))
    return out


def test_subtract_a_middle_block_leaves_four_slabs():
    box, cut = Region((0, 0), (4, 6)), Region((1, 2), (2, 2))
    parts = subtract(box, cut)
    assert parts == [Region((0, 0), (1, 6)), Region((3, 0), (1, 6)), Region((1, 0), (2, 2)), Region((1, 4), (2, 2))]
    assert cells(parts) == cells([box]) - cells([cut])


def test_fused_qkv_missing_its_k_rows_is_reported_exactly():
    # qkv rows on one TP rank: q 0:8, k 8:10, v 10:12, 4 columns; the source sent q and v only.
    left = uncovered((12, 4), [Region((0, 0), (8, 4)), Region((10, 0), (2, 4))])
    assert left == [Region((8, 0), (2, 4))]
    assert format_regions(left) == "[8:10, 0:4]"
    assert uncovered((12, 4), [Region((0, 0), (12, 4))]) == []
    assert uncovered((0, 4), []) == [] and uncovered((), [Region((), ())]) == []


def test_random_covers_match_an_explicit_cell_set():
    rng = random.Random(0)
    for _ in range(200):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        cuts = []
        for _ in range(rng.randint(0, 5)):
            off = tuple(rng.randrange(s) for s in shape)
            cuts.append(Region(off, tuple(rng.randint(1, s - o) for o, s in zip(off, shape))))
        left = uncovered(shape, cuts)
        assert cells(left) == cells([Region.full(shape)]) - cells(cuts)
        assert sum(r.numel for r in left) == len(cells(left)), "the parts are disjoint"


def test_format_regions_limits_the_list():
    regions = [Region((i,), (1,)) for i in range(5)]
    assert format_regions(regions, limit=2) == "[0:1], [1:2] and 3 more"


@pytest.mark.parametrize("shape", [(3,), (2, 2, 2)])
def test_nothing_written_leaves_the_whole_tensor(shape):
    assert uncovered(shape, []) == [Region.full(shape)]
