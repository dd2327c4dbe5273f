"""Delta encoding in one process: bitwise diffs (signed zeros and NaN payloads count), sparse messages
that decode to what was encoded and patch strided targets bit-exactly, the trainer's baseline (dense
at the first sync, sparse only where smaller, the new values kept), and ``run_rounds`` moving a mix
of sparse and dense messages over a loopback plane to exactly the reference executor's values."""

from __future__ import annotations

import pytest
import torch

from helpers import execute_reference, make_local_shards
from test_m2n_rounds import SRC, Loopback
from weightsync.plan import DestPiece, Region, Shard, TensorSource, build_plan, mesh_coordinates, source_regions
from weightsync.reshard.delta import Baseline, _layout, decode, diff, encode, patch, sparse_nbytes
from weightsync.reshard.handshake import my_messages, run_rounds


def test_diff_is_bitwise():
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0, -3.0], dtype=torch.bfloat16)
    new = base.clone()
    new[0] = -0.0  # equal as floats, different bits
    new[2] = torch.tensor(-0x7F81, dtype=torch.int16).view(torch.bfloat16)  # another NaN payload
    new[4] = -3.0  # same
    mask, vals = diff(new, base)
    assert mask.tolist() == [True, False, True, False, False]
    assert torch.equal(vals, new.view(torch.int16)[[0, 2]])
    assert not diff(base, base)[0].any()  # NaN vs the same NaN: unchanged


@pytest.mark.parametrize("rows, where", [(6, "bitmap"), (60, "positions")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.uint8])
def test_encode_decode_patch_into_strided_targets(dtype, rows, where):
    """Six changes in 67 values go as bitmaps (fewer bytes than 6 positions), in 607 as positions."""
    g = torch.Generator().manual_seed(0)
    olds = [torch.randint(0, 100, (rows, 10), generator=g).to(dtype),
            torch.randint(0, 100, (7,), generator=g).to(dtype)]
    news = [o.clone() for o in olds]
    news[0][1, 3:6], news[0][3, 0], news[0][5, 9], news[1][6] = 101, 102, 103, 104
    numels = [o.numel() for o in olds]
    assert _layout(numels, 6, dtype.itemsize)[0] == (where == "bitmap")
    parts = [diff(n, o) for n, o in zip(news, olds)]
    buf = encode(parts, dtype.itemsize)
    assert buf.dtype == torch.uint8 and buf.numel() == sparse_nbytes(numels, 6, dtype.itemsize)
    decoded = decode(buf, numels, 6, dtype.itemsize)
    assert [p.tolist() for p, _ in decoded] == [[13, 14, 15, 30, 59], [6]]
    # the targets: a column slice of a bigger parameter (not contiguous) and a contiguous one
    param = torch.zeros(rows, 16, dtype=dtype)
    param[:, 4:14] = olds[0]
    vec = olds[1].clone()
    patch(param[:, 4:14], *decoded[0])
    patch(vec, *decoded[1])
    assert torch.equal(param[:, 4:14], news[0]) and torch.equal(vec, news[1])
    assert param[:, :4].eq(0).all() and param[:, 14:].eq(0).all()  # nothing outside the region
    with pytest.raises(ValueError, match="the 7 values announced"):
        decode(buf, numels, 7, dtype.itemsize)


def plan_for(shapes: dict[str, tuple[int, ...]], pieces: list[DestPiece], dtype: str = "bfloat16"):
    sources = [TensorSource(n, s, dtype, source_regions(s, (1,), [Shard(0)], mesh_coordinates((1,))))
               for n, s in shapes.items()]
    return sources, build_plan(sources, [pieces])


SHAPES = {"rows": (64, 32), "cols": (32, 48), "small_a": (3, 5), "small_b": (7,)}
PIECES = [DestPiece("rows", Region((16, 0), (40, 32)), "p_rows", (0, 0)),   # contiguous rows (direct when dense)
          DestPiece("cols", Region((0, 8), (32, 24)), "p_cols", (0, 0)),    # a column slice
          DestPiece("small_a", Region((0, 0), (3, 5)), "p_small", (1, 0)),  # small ones share a message
          DestPiece("small_b", Region((0,), (7,)), "p_b", (0,))]
PARAMS = {"p_rows": (40, 32), "p_cols": (32, 24), "p_small": (4, 5), "p_b": (7,)}


def test_baseline_is_dense_first_then_sparse_where_smaller():
    sources, plan = plan_for(SHAPES, PIECES)
    rounds = my_messages(plan, sources, rank=0, sender=True, cap=1 << 11)
    dtypes = {s.name: s.dtype for s in sources}
    full = {n: torch.randn(s) for n, s in SHAPES.items()}  # fp32 master, bf16 on the wire
    shards = make_local_shards(full, sources)[0]
    b = Baseline()
    first = b.encode(rounds, shards, dtypes, eligible=lambda m: True)
    assert first.payloads == {} and first.compared == 0  # no version yet: all dense
    assert all(torch.equal(b.tensors[n], shards[n].to(torch.bfloat16)) for n in shards)
    b.version = 1
    old = {n: t.clone() for n, t in b.tensors.items()}
    shards["rows"][20, 5] += 1.0     # one changed value in the rows
    shards["cols"][:, 8:32] += 1.0   # every value in the column slice
    enc = b.encode(rounds, shards, dtypes, eligible=lambda m: True)
    assert enc.changed == 1 + 32 * 24 and enc.compared == sum(p.region.numel for p in PIECES)
    for m in (m for r in rounds for m in r):  # sparse exactly where that is smaller than dense
        changed = sum(int((shards[it.name].to(torch.bfloat16) != old[it.name])[
            tuple(slice(o, o + k) for o, k in zip(it.src_offsets, it.region.sizes))].sum()) for it in m.items)
        smaller = sparse_nbytes([it.region.numel for it in m.items], changed, 2) < m.nbytes
        assert ((m.dst, m.index) in enc.payloads) == smaller, m
        assert enc.counts.get("0", {}).get(str(m.index)) == (changed if smaller else None)
    assert all(torch.equal(b.tensors[n], shards[n].to(torch.bfloat16)) for n in shards)
    b.version = 2
    for t in shards.values():  # every value changes: every message dense
        t += 1.0
    assert b.encode(rounds, shards, dtypes, eligible=lambda m: True).payloads == {}
    assert b.nbytes == sum(s.numel() * 2 for s in shards.values())


@pytest.mark.parametrize("changed", [0, 3, 200])
def test_sparse_and_dense_messages_through_run_rounds_match_the_reference(changed):
    sources, plan = plan_for(SHAPES, PIECES)
    dtypes = {s.name: s.dtype for s in sources}
    g = torch.Generator().manual_seed(changed)
    full = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}
    staging = 1 << 12
    send_rounds = my_messages(plan, sources, rank=0, sender=True, cap=staging // 2)
    recv_rounds = my_messages(plan, sources, rank=0, sender=False, cap=staging // 2)
    assert len(send_rounds) >= 2

    def sync(shards, got, sparse_send, sparse_recv):
        plane, sums_s, sums_r = Loopback(), {}, {}
        sent = run_rounds(plane, send_rounds, torch.empty(staging, dtype=torch.uint8), sender=True,
                          peer_rank=lambda w: 1 + w, dtypes=dtypes, sums=sums_s, sparse=sparse_send,
                          tensor_of=lambda m, i: shards[m.items[i].name])
        recv = Loopback({(SRC, tag): t for (_, tag), t in plane.wire.items()})
        received = run_rounds(recv, recv_rounds, torch.empty(staging, dtype=torch.uint8), sender=False,
                              peer_rank=lambda r: r, dtypes=dtypes, sums=sums_r, sparse=sparse_recv,
                              tensor_of=lambda m, i: got[m.items[i].param])
        assert sent == received and not recv.wire and sums_s == {0: sums_r[0]}
        return sent

    shards = make_local_shards(full, sources)[0]
    got = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in PARAMS.items()}
    baseline = Baseline()
    baseline.encode(send_rounds, shards, dtypes, eligible=lambda m: True)
    dense = sync(baseline.tensors, got, {}, {})
    baseline.version = 1
    # an optimizer step that changes `changed` values spread over every tensor
    flat = torch.cat([t.reshape(-1) for t in full.values()])
    idx = torch.randperm(flat.numel(), generator=g)[:changed]
    flat[idx] = flat[idx] * 2 + 1
    at = 0
    for t in full.values():
        t.copy_(flat[at : at + t.numel()].view(t.shape))
        at += t.numel()
    shards = make_local_shards(full, sources)[0]
    enc = baseline.encode(send_rounds, shards, dtypes, eligible=lambda m: True)
    sparse_recv = {(SRC, int(k)): n for k, n in enc.counts.get("0", {}).items()}
    moved = sync(baseline.tensors, got, enc.payloads, sparse_recv)
    want = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in PARAMS.items()}
    execute_reference(plan, {0: shards}, {0: want})
    for n in PARAMS:
        assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), n
    if changed == 0:  # every message sparse with nothing in it: a few count words each
        assert len(enc.payloads) == sum(map(len, send_rounds)) and moved < dense // 50
    elif changed == 3:
        assert enc.changed <= 3 and moved < dense // 10
    else:
        assert moved <= dense


@pytest.mark.parametrize("backend, fields, message", [
    ("weightsync_m2n", {"delta": True, "cast_dtypes": True}, r"delta needs the wire dtype to be the parameters' dtype"),
    ("weightsync_nccl", {"delta": "yes"}, r"NCCLTrainerInitInfo.delta must be a bool, got 'yes'"),
    ("weightsync_m2n", {"delta": True, "delta_baseline": "gpu"},
     r"delta_baseline must be 'cpu' or 'device', got 'gpu'"),
    ("weightsync_ipc", {"delta": True}, r"delta=True is for transports with a wire"),
], ids=["with cast_dtypes", "not a bool", "baseline place", "ipc"])
def test_delta_init_infos_that_cannot_work_are_refused_at_construction(backend, fields, message):
    from weightsync.testing.cluster import Layout, init_info

    with pytest.raises(ValueError, match=message):
        init_info(Layout(trainers=2, tp=2, backend=backend), **fields)
