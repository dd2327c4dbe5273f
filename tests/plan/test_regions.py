"""Regions and DTensor placements, checked against torch's own local-shape/offset function; coverage
(what a set of writes leaves untouched), checked against explicit cell sets."""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch

from helpers import shard_tensor
from weightsync.plan import (
    Region,
    Replicate,
    Shard,
    local_region,
    mesh_coordinates,
    placements_from_torch,
    source_regions,
)
from weightsync.plan.regions import format_regions, subtract, uncovered


def _torch_local(shape, mesh_shape, coordinate, placements):
    """torch's (local_shape, global_offset) via the plain-data twin of compute_local_shape_and_global_offset."""
    utils = pytest.importorskip("torch.distributed.tensor._utils")
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    tp = [TShard(p.dim) if isinstance(p, Shard) else TReplicate() for p in placements]
    return utils._compute_local_shape_and_global_offset(list(shape), list(mesh_shape), list(coordinate), tp)


def test_region_basics():
    r = Region((1, 2), (3, 4))
    assert (r.ndim, r.numel, r.is_empty, r.end) == (2, 12, False, (4, 6))
    assert Region.full((5, 6)) == Region((0, 0), (5, 6))
    assert Region((0, 3), (2, 0)).is_empty
    assert r.slices() == (slice(1, 4), slice(2, 6))
    assert r.shift((1, 1)) == Region((0, 1), (3, 4))
    assert Region.full((4, 8)).contains(r) and not r.contains(Region.full((4, 8)))
    scalar = Region((), ())
    assert (scalar.ndim, scalar.numel, scalar.is_empty) == (0, 1, False)
    assert Region([1, 2], [3, 4]) == r  # lists become tuples
    assert hash(Region([1, 2], [3, 4])) == hash(r)


def test_intersect():
    a = Region((0, 0), (4, 4))
    assert a.intersect(Region((2, 3), (5, 5))) == Region((2, 3), (2, 1))
    assert a.intersect(Region((4, 0), (2, 2))) is None  # touching is no overlap
    assert a.intersect(Region((1, 1), (0, 2))) is None  # empty
    assert a.intersect(Region((9, 9), (1, 1))) is None
    assert Region((), ()).intersect(Region((), ())) == Region((), ())
    with pytest.raises(ValueError, match=re.escape("cannot intersect regions of different ndim")):
        a.intersect(Region((0,), (1,)))


def test_region_validation():
    msg = "offsets and sizes must have the same length, got offsets (0,) and sizes (1, 2)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        Region((0,), (1, 2))
    with pytest.raises(ValueError, match=re.escape("sizes must be non-negative, got (-1,) (offsets (0,))")):
        Region((0,), (-1,))
    with pytest.raises(TypeError, match="offsets must be a sequence of ints"):
        Region((0.5,), (1,))
    with pytest.raises(ValueError, match=re.escape("origin_offsets must have 2 entries")):
        Region((0, 0), (1, 1)).shift((0,))


def test_shard_tensor_views_the_region():
    full = torch.arange(64).reshape(8, 8)
    piece = shard_tensor(full, Region((2, 4), (3, 2)))
    assert torch.equal(piece, full[2:5, 4:6])
    assert piece.data_ptr() == full[2:5, 4:6].data_ptr()
    with pytest.raises(ValueError, match="has ndim 1"):
        shard_tensor(full, Region((0,), (1,)))


def test_uneven_fsdp_rows():
    # 5 rows over 4 ranks: torch.chunk style 2/2/1/0; the empty shard sits at offset 5.
    got = [local_region((5, 3), (4,), (r,), [Shard(0)]) for r in range(4)]
    assert got == [
        Region((0, 0), (2, 3)),
        Region((2, 0), (2, 3)),
        Region((4, 0), (1, 3)),
        Region((5, 0), (0, 3)),
    ]


def test_nested_shard_and_hsdp():
    # Two mesh dims shard dim 0: first 5 -> 3/2, then each piece over 2 -> (2,1) and (1,1).
    got = [local_region((5,), (2, 2), c, [Shard(0), Shard(0)]) for c in mesh_coordinates((2, 2))]
    assert got == [Region((0,), (2,)), Region((2,), (1,)), Region((3,), (1,)), Region((4,), (1,))]
    hsdp = source_regions((4, 2), (2, 2), [Replicate(), Shard(0)], mesh_coordinates((2, 2)))
    assert hsdp == (Region((0, 0), (2, 2)), Region((2, 0), (2, 2))) * 2
    assert hsdp[0] is hsdp[2]  # replicated ranks share one Region object
    assert local_region((4, 6), (2,), (1,), [Shard(-1)]) == Region((0, 3), (4, 3))


def _shapes():
    sizes = (0, 1, 2, 3, 5, 7, 8)
    yield from ((a,) for a in sizes)
    yield from itertools.product((1, 3, 5, 8), (0, 2, 7))
    yield from ((2, 3, 5), (5, 1, 4), (4, 4, 0))


def _placement_choices(ndim):
    return [Replicate()] + [Shard(d) for d in range(ndim)]


def test_local_region_matches_torch_exhaustively():
    meshes = [(1,), (2,), (3,), (4,), (5,), (2, 2), (2, 3), (3, 2), (1, 4), (4, 1)]
    checked = 0
    for shape in _shapes():
        for mesh in meshes:
            for places in itertools.product(_placement_choices(len(shape)), repeat=len(mesh)):
                for coord in mesh_coordinates(mesh):
                    region = local_region(shape, mesh, coord, places)
                    t_shape, t_offset = _torch_local(shape, mesh, coord, places)
                    assert (region.sizes, region.offsets) == (tuple(t_shape), tuple(t_offset)), (
                        shape, mesh, places, coord,
                    )
                    checked += 1
    assert checked > 5000


def test_local_region_matches_chunk_data():
    # Beyond offsets: the data torch.chunk gives each rank is the region's slice.
    full = torch.arange(7 * 3).reshape(7, 3)
    for n in range(1, 6):
        chunks = list(torch.chunk(full, n, dim=0))
        for r in range(n):
            region = local_region((7, 3), (n,), (r,), [Shard(0)])
            expected = chunks[r] if r < len(chunks) else full[7:]
            assert torch.equal(shard_tensor(full, region), expected)


def test_placements_from_torch():
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    assert placements_from_torch([TReplicate(), TShard(1), Shard(0)]) == (Replicate(), Shard(1), Shard(0))
    with pytest.raises(ValueError, match=re.escape("placements[0] is a strided shard")):
        placements_from_torch([_StridedShard(0, split_factor=2)])
    with pytest.raises(ValueError, match=re.escape("placements[1] must be a Shard or Replicate placement")):
        placements_from_torch([TReplicate(), Partial()])
    # torch placements work directly in local_region too
    assert local_region((6,), (3,), (2,), [TShard(0)]) == Region((4,), (2,))


def test_mesh_and_placement_errors():
    with pytest.raises(ValueError, match=re.escape("placements must have one entry per mesh dim: mesh_shape (2, 2)")):
        local_region((4,), (2, 2), (0, 0), [Shard(0)])
    with pytest.raises(ValueError, match=re.escape("coordinate (2,) is outside mesh_shape (2,) in mesh dim 0")):
        local_region((4,), (2,), (2,), [Shard(0)])
    with pytest.raises(ValueError, match=re.escape("Shard(dim=1) on mesh dim 0 is out of range for global_shape (4,)")):
        local_region((4,), (2,), (0,), [Shard(1)])
    with pytest.raises(ValueError, match=re.escape("coordinate (0,) must have one entry per mesh dim")):
        local_region((4,), (2, 2), (0,), [Shard(0), Shard(0)])
    with pytest.raises(ValueError, match="mesh_shape entries must be positive"):
        mesh_coordinates((2, 0))
    with pytest.raises(TypeError, match=r"Shard\.dim must be an int"):
        Shard("0")  # type: ignore[arg-type]


def test_mesh_coordinates_row_major():
    assert mesh_coordinates((2, 3)) == ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2))
    assert mesh_coordinates((3,)) == ((0,), (1,), (2,))


# --- coverage ----------------------------------------------------------------------------------------

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
