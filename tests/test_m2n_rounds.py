"""``m2n_rounds.run_rounds`` in one process, over a loopback data plane that records what each rank
posts: pipelined rounds (staged rounds ``DEPTH`` in flight and waited in order, no two posted buffers
sharing a byte, so staging is reused only after its round was waited for), direct messages (one
contiguous item sent from the shard / received into the parameter without a staging copy, posted as
their round comes and waited for at the end) and staged ones (column slices, several items, a dtype
cast) give every parameter exactly the reference executor's values, and both ends move the same
bytes; on a plane whose ops run in issue order (NCCL) a round is posted whole."""

from __future__ import annotations

import pytest
import torch

from helpers import execute_reference, make_local_shards
from oracle import item_rounds
from weightsync.plan import DestPiece, Region, Shard, TensorSource, build_plan, mesh_coordinates, source_regions
from weightsync.plan.schedule import Message
from weightsync.plan.transfer import TransferItem
from weightsync.reshard import executor as m2n_rounds
from weightsync.reshard.executor import run_rounds
from weightsync.reshard.handshake import my_messages


class Loopback:
    """Sender side records each send's bytes when it is waited for (as the wire would carry them
    then); receiver side fills each receive from those records at its wait. ``ordered``: the plane
    runs ops in issue order (NCCL), so the executor must post each round whole."""

    def __init__(self, wire: dict | None = None, *, ordered: bool = False, staging: torch.Tensor | None = None) -> None:
        self.wire = {} if wire is None else wire
        self.ordered = ordered
        self.staging = staging  # to tell staged rounds (their order is checked) from direct messages
        self.posted: list[list] = []  # works posted and not waited for, in post order
        self.max_in_flight = 0  # staged rounds posted at once
        self.highest = 0  # the highest byte address a posted buffer reached
        self.rounds: list[set] = []  # per post: its (peer, tag)s
        self.waited: list[set] = []  # per wait: its (peer, tag)s
        self.drained = False

    def post(self, sends, recvs):
        assert not self.drained, "posted after waiting for staged rounds out of order"
        works = [("send", t, peer, tag) for t, peer, tag in sends] + [("recv", t, peer, tag) for t, peer, tag in recvs]
        spans = [_span(t) for w in self.posted for _, t, _, _ in w]
        for _, t, _, _ in works:
            lo, hi = _span(t)
            assert all(hi <= a or b <= lo for a, b in spans), "a posted buffer shares bytes with one in flight"
            spans.append((lo, hi))
            self.highest = max(self.highest, hi)
        self.posted.append(works)
        self.rounds.append({(peer, tag) for _, _, peer, tag in works})
        self.max_in_flight = max(self.max_in_flight, sum(map(self._staged, self.posted)))
        return works

    def wait_all(self, works, what=""):
        ids = {id(w) for w in works}
        at = next(i for i, posted in enumerate(self.posted) if {id(w) for w in posted} == ids)
        if self.staging is not None and self._staged(self.posted[at]) and any(map(self._staged, self.posted[:at])):
            self.drained = True  # a staged round waited for out of order: only once nothing more is posted
        done = self.posted.pop(at)
        self.waited.append({(peer, tag) for _, _, peer, tag in done})
        for kind, t, peer, tag in done:
            if kind == "send":
                self.wire[(peer, tag)] = t.clone()
            else:
                t.copy_(self.wire.pop((SRC, tag)))

    def _staged(self, works) -> bool:
        if self.staging is None:
            return True  # not told: every group counts
        lo, hi = _span(self.staging)
        return any(lo <= _span(t)[0] < hi for _, t, _, _ in works)


SRC = 0  # the one trainer rank's data-plane rank; the worker is rank 1


def _span(t):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


@pytest.mark.parametrize("staging", [1 << 11, 1 << 12, 1 << 13], ids=["cap-1k", "cap-2k", "cap-4k"])
def test_pipelined_rounds_direct_and_staged_match_the_reference(staging, monkeypatch):
    shapes = {"rows": (64, 32), "cols": (32, 48), "small_a": (3, 5), "small_b": (7,)}
    sources = [TensorSource(n, s, "float32", source_regions(s, (1,), [Shard(0)], mesh_coordinates((1,))))
               for n, s in shapes.items()]
    pieces = [DestPiece("rows", Region((16, 0), (40, 32)), "p_rows", (0, 0)),       # contiguous rows: direct
              DestPiece("cols", Region((0, 8), (32, 24)), "p_cols", (0, 0)),        # a column slice: staged
              DestPiece("small_a", Region((0, 0), (3, 5)), "p_small", (1, 0)),      # small: packed together
              DestPiece("small_b", Region((0,), (7,)), "p_b", (0,))]
    params = {"p_rows": (40, 32), "p_cols": (32, 24), "p_small": (4, 5), "p_b": (7,)}
    dtypes = {"p_rows": torch.float32, "p_cols": torch.float32, "p_small": torch.float64, "p_b": torch.float32}
    plan = build_plan(sources, [pieces])
    full = {n: torch.randn(s) for n, s in shapes.items()}
    shards = make_local_shards(full, sources)[0]
    want = {n: torch.zeros(s, dtype=dtypes[n]) for n, s in params.items()}
    execute_reference(plan, {0: shards}, {0: want})
    got = {n: torch.zeros(s, dtype=dtypes[n]) for n, s in params.items()}
    wire_dtypes = {s.name: s.dtype for s in sources}

    direct = []
    real = m2n_rounds._Executor._direct
    monkeypatch.setattr(m2n_rounds._Executor, "_direct",
                        lambda self, m: direct.append(r) or r if (r := real(self, m)) is not None else None)
    send_staging, recv_staging = torch.empty(staging, dtype=torch.uint8), torch.empty(staging, dtype=torch.uint8)
    send_plane = Loopback(staging=send_staging)
    send_rounds = my_messages(plan, sources, rank=0, sender=True, cap=staging // 2)
    recv_rounds = my_messages(plan, sources, rank=0, sender=False, cap=staging // 2)
    assert len(send_rounds) == len(recv_rounds) >= 2
    sent_sums, recv_sums = {}, {}
    sent = run_rounds(send_plane, send_rounds, send_staging, sender=True,
                      peer_rank=lambda w: 1 + w, dtypes=wire_dtypes, sums=sent_sums,
                      tensor_of=lambda m, i: shards[m.items[i].name])
    wire = {(SRC, tag): t for (_, tag), t in send_plane.wire.items()}
    recv_plane = Loopback(wire, staging=recv_staging)
    received = run_rounds(recv_plane, recv_rounds, recv_staging, sender=False,
                          peer_rank=lambda r: r, dtypes=wire_dtypes, sums=recv_sums,
                          tensor_of=lambda m, i: got[m.items[i].param])
    assert sent == received == plan.coverage().lower_bound[0] and not recv_plane.wire
    # staged rounds pipelined (the sender stages the column slices), never more than DEPTH of them
    assert 2 <= send_plane.max_in_flight <= m2n_rounds.DEPTH and 1 <= recv_plane.max_in_flight <= m2n_rounds.DEPTH
    for n in params:
        assert torch.equal(got[n], want[n]), n
    assert sent_sums == {0: recv_sums[0]}
    assert direct and all(t.dtype == torch.uint8 for t in direct)  # the rows went without a staging copy


@pytest.mark.parametrize("ordered", [False, True], ids=["gloo", "nccl-ordered"])
def test_direct_messages_go_early_and_whole_rounds_on_an_ordered_plane(ordered):
    """One trainer rank -> 2 workers: worker 0's rows are contiguous in the shard (direct), worker 1's
    columns are not (staged), so each round mixes both. Where ops run on their own (gloo) the
    direct sends are posted apart, as their round comes, and waited for after every staged round,
    the last posted first; where they run in issue order (NCCL) each round is posted whole. Either
    way the worker gets exactly the reference's values and the checksums agree."""
    shape = (16, 8)
    sources = [TensorSource("t", shape, "float32", source_regions(shape, (1,), [Shard(0)], mesh_coordinates((1,))))]
    dests = [[DestPiece("t", Region((0, 0), (8, 8)), "p", (0, 0))],  # whole rows: direct
             [DestPiece("t", Region((0, 2), (16, 4)), "p", (0, 0))]]  # columns 2..5: strided, staged
    plan = build_plan(sources, dests)
    shard = torch.randn(shape)
    cap = 64  # 2 of worker 0's rows, 4 of worker 1's: 4 rounds of one message to each worker
    rounds = my_messages(plan, sources, rank=0, sender=True, cap=cap)
    assert len(rounds) == 4 and all(len(rnd) == 2 for rnd in rounds)
    staging = torch.empty(2 * cap, dtype=torch.uint8)
    plane, sums = Loopback(ordered=ordered, staging=staging), {}
    run_rounds(plane, rounds, staging, sender=True, peer_rank=lambda w: 1 + w, dtypes={"t": "float32"},
               tensor_of=lambda m, i: shard, sums=sums)
    if ordered:
        assert plane.rounds == [{(1, k), (2, k)} for k in range(4)]
    else:
        assert plane.rounds == [group for k in range(4) for group in ({(1, k)}, {(2, k)})]
    # staged rounds pipelined 2 deep (the staging holds two), then the rest the last posted first
    assert plane.waited == ([{(1, 0), (2, 0)}, {(1, 1), (2, 1)}, {(1, 3), (2, 3)}, {(1, 2), (2, 2)}] if ordered else
                            [{(2, 0)}, {(2, 1)}, {(2, 3)}, {(2, 2)}] + [{(1, k)} for k in (3, 2, 1, 0)])
    want = [shard[:8], shard[:, 2:6]]
    for w in (0, 1):
        got = torch.cat([plane.wire[(1 + w, k)].view(torch.float32) for k in range(4)])
        assert torch.equal(got, want[w].reshape(-1))
    recv_sums = {}
    for w in (0, 1):
        param = torch.zeros(want[w].shape)
        recv = Loopback({(SRC, k): plane.wire[(1 + w, k)] for k in range(4)})
        run_rounds(recv, my_messages(plan, sources, rank=w, sender=False, cap=cap),
                   torch.empty(2 * cap, dtype=torch.uint8), sender=False, peer_rank=lambda r: r,
                   dtypes={"t": "float32"}, tensor_of=lambda m, i, param=param: param, sums=(got := {}))
        assert torch.equal(param, want[w])
        recv_sums[w] = got[0]
    assert sums == recv_sums


def test_with_ready_a_sender_packs_what_needs_no_wait_and_posts_nothing_before_ready():
    """``ready`` (the engines starting): the sender packs its staged rounds until one would have to be
    waited for (here the staging holds two), posts nothing before ``ready()`` returned, then posts and
    waits exactly as without it; when ``ready()`` raises, nothing is ever posted."""
    shape = (16, 8)
    sources = [TensorSource("t", shape, "float32", source_regions(shape, (1,), [Shard(0)], mesh_coordinates((1,))))]
    dests = [[DestPiece("t", Region((0, 0), (8, 8)), "p", (0, 0))],  # whole rows: direct
             [DestPiece("t", Region((0, 2), (16, 4)), "p", (0, 0))]]  # columns 2..5: staged, 4 rows a round
    plan = build_plan(sources, dests)
    shard, cap = torch.randn(shape), 64
    rounds = my_messages(plan, sources, rank=0, sender=True, cap=cap)
    kwargs = dict(sender=True, peer_rank=lambda w: 1 + w, dtypes={"t": "float32"}, tensor_of=lambda m, i: shard)
    plain = Loopback()
    run_rounds(plain, rounds, torch.empty(2 * cap, dtype=torch.uint8), **kwargs)
    staging, plane, seen = torch.empty(2 * cap, dtype=torch.uint8), Loopback(), []

    def ready():
        seen.append((list(plane.rounds), staging.view(torch.float32).clone()))
    run_rounds(plane, rounds, staging, ready=ready, **kwargs)
    (posted, staged), = seen
    assert posted == [] and torch.equal(staged, shard[:8, 2:6].reshape(-1))  # rounds 0 and 1 packed
    assert plane.rounds == plain.rounds and plane.waited == plain.waited
    assert plane.wire.keys() == plain.wire.keys() and all(torch.equal(plane.wire[k], plain.wire[k]) for k in plain.wire)

    def refused():
        raise RuntimeError("the engines refused the update")
    plane = Loopback()
    with pytest.raises(RuntimeError, match="refused"):
        run_rounds(plane, rounds, torch.empty(2 * cap, dtype=torch.uint8), ready=refused, **kwargs)
    assert plane.rounds == []


def test_a_round_stages_only_the_bytes_it_needs_in_the_lowest_free_span():
    """Rounds that each stage a quarter of the staging buffer keep four in flight (not two halves'
    worth), reusing the spans the oldest rounds free, with no posted buffer sharing a byte; rounds
    that stage less stay in the low bytes; a round that needs more staging than there is raises
    before it is posted."""
    shard = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    rounds = [[Message(0, 0, k, (TransferItem(0, 0, "t", Region((0, k), (16, 1)), (0, k), "p", (0, k)),), (0,), 64)]
              for k in range(8)]  # column k: 64 bytes, strided in the shard, so sent from a staging copy
    plane = Loopback()
    moved = run_rounds(plane, rounds, torch.empty(256, dtype=torch.uint8), sender=True, peer_rank=lambda w: 1 + w,
                       dtypes={"t": "float32"}, tensor_of=lambda m, i: shard)
    assert moved == 8 * 64 and plane.max_in_flight == min(4, m2n_rounds.DEPTH)
    assert [plane.wire[(1, k)].view(torch.float32).tolist() for k in range(8)] == shard.T.tolist()
    staging, plane = torch.empty(1024, dtype=torch.uint8), Loopback()
    run_rounds(plane, rounds * 2, staging, sender=True, peer_rank=lambda w: 1 + w, dtypes={"t": "float32"},
               tensor_of=lambda m, i: shard)  # 16 rounds, at most DEPTH x 64 bytes in flight, of 1024
    assert plane.highest == staging.data_ptr() + min(8, m2n_rounds.DEPTH) * 64
    with pytest.raises(ValueError, match="needs 64 bytes of staging, more than the 0 there are"):
        run_rounds(Loopback(), rounds, torch.empty(0, dtype=torch.uint8), sender=True, peer_rank=lambda w: 1 + w,
                   dtypes={"t": "float32"}, tensor_of=lambda m, i: shard)


def test_rounds_kept_as_arrays_equal_the_item_by_item_cut_on_both_ends():
    """A rank's rounds are cut once into arrays (``Rounds.compact``), whatever its item count: the
    same messages as the item-by-item cut (``PairItems.rounds``), on both ends, pass after pass
    (2 trainer ranks -> 3 workers, rows and columns)."""
    shapes = {"a": (12, 10), "b": (9, 14), "c": (5,)}
    sources = [TensorSource(n, s, "float32", source_regions(s, (2,), [Shard(0)], mesh_coordinates((2,))))
               for n, s in shapes.items()]
    dests = [[DestPiece("a", Region((4 * w, 0), (4, 10)), "pa", (0, 0)),
              DestPiece("b", Region((0, 5 * w), (9, min(5, 14 - 5 * w))), "pb", (0, 0)),
              DestPiece("c", Region((0,), (5,)), "pc", (0,))] for w in range(3)]
    plan = build_plan(sources, dests)
    size = {n: 4 for n in shapes}.__getitem__
    send = [my_messages(plan, sources, rank=r, sender=True, cap=128) for r in range(2)]
    recv = [my_messages(plan, sources, rank=w, sender=False, cap=128) for w in range(3)]
    for rank, (rs, sender) in enumerate([(r, True) for r in send] + [(r, False) for r in recv]):
        rank = rank if sender else rank - 2
        want = list(item_rounds(plan.pairs(rank, sender=sender), cap=128, itemsize_of=size))
        assert list(rs) == list(rs) == want and len(rs) == len(want) >= 2
        assert rs.nbytes == sum(m.nbytes for r in want for m in r) and rs.kept_bytes() > 0
    by_send = {(m.src, m.dst, m.index): m for rs in send for rnd in rs for m in rnd}
    by_recv = {(m.src, m.dst, m.index): m for rs in recv for rnd in rs for m in rnd}
    assert by_send == by_recv and len(by_send) > 3


def test_byte_runs_views_equal_the_boxes_bytes_and_grouped_views_equal_single_ones():
    """``ByteRuns.box``: a box of a contiguous tensor as bytes (one slice when it is one run, else a
    strided byte view) holds exactly ``t[box]``'s bytes; None for a tensor that is not contiguous.
    ``likes``: boxes back to back in a buffer, grouped by shape, view the same bytes as ``like``."""
    from weightsync.plan.regions import box_slices
    from weightsync.reshard.packing import ByteRuns

    t = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)
    runs = ByteRuns()
    boxes = [((1, 0, 0), (2, 6, 5)), ((2, 3, 0), (1, 2, 5)), ((0, 1, 2), (3, 2, 3)), ((3, 5, 4), (1, 1, 1)),
             ((0, 0, 1), (4, 6, 2)), ((1, 2, 0), (2, 2, 5))]
    views = []
    for off, size in boxes:
        v = runs.box(t, off, size)
        want = t[box_slices(off, size)].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(v.reshape(-1), want), (off, size)
        runs_whole = (((1, 0, 0), (2, 6, 5)), ((2, 3, 0), (1, 2, 5)), ((3, 5, 4), (1, 1, 1)))
        assert (v.dim() == 1) == ((off, size) in runs_whole)
        views.append(v)
    assert runs.box(t.transpose(0, 2), (0, 0, 0), (1, 1, 1)) is None
    same = [runs.box(t, (0, 0, 0), (2, 2, 2)), runs.box(t, (1, 0, 0), (2, 2, 2)), runs.box(t, (2, 1, 0), (2, 2, 2))]
    offsets, at = [], 0
    for v in [*views, *same]:
        offsets.append(at)
        at += v.numel()
    buf = torch.arange(at, dtype=torch.int64).to(torch.uint8)
    grouped = runs.likes(buf, tuple(offsets), [*views, *same])
    for g, off, v in zip(grouped, offsets, [*views, *same]):
        single = runs.like(buf, off, v)
        assert g.shape == v.shape and torch.equal(g, single) and g.data_ptr() == single.data_ptr()
    with_gap = runs.likes(buf, (0, 1), [None, views[3]])
    assert with_gap[0] is None and torch.equal(with_gap[1], buf[1:5])


def test_spans_found_on_the_first_sync_serve_the_next_ones_and_yield_to_a_new_layout():
    """A staged message's byte spans, and where a direct one is in its tensor, are found once
    (``Rounds.spans``) and cut from each sync's own tensors after: three syncs of new values into new
    tensors give the reference's values each time (a box that is not one run of its tensor too, as a
    strided view); when a target's layout changes (here: a transposed copy, not contiguous) its message
    is applied item by item again, still exactly."""
    shapes = {"a": (6, 4), "b": (3, 8), "c": (5,), "d": (2, 3, 4)}
    sources = [TensorSource(n, s, "float32", source_regions(s, (1,), [Shard(0)], mesh_coordinates((1,))))
               for n, s in shapes.items()]
    pieces = [DestPiece("a", Region((0, 0), (6, 4)), "pa", (1, 0)),
              DestPiece("b", Region((1, 0), (2, 8)), "pb", (0, 0)),
              DestPiece("c", Region((0,), (5,)), "pc", (2,)),
              DestPiece("d", Region((0, 1, 0), (2, 2, 4)), "pd", (0, 0, 0))]
    params = {"pa": (7, 4), "pb": (2, 8), "pc": (7,), "pd": (2, 2, 4)}
    plan = build_plan(sources, [pieces])
    send, recv = (my_messages(plan, sources, rank=0, sender=s, cap=1 << 10, alone=96) for s in (True, False))
    assert sum(len(m.items) > 1 for rnd in send for m in rnd) >= 1  # the small pieces share a staged message
    assert sum(m.nbytes >= 96 and len(m.items) == 1 for rnd in send for m in rnd) >= 1  # "a" goes alone: direct
    wire_dtypes = {s.name: s.dtype for s in sources}
    for sync in range(4):
        full = {n: torch.randn(s) for n, s in shapes.items()}
        shards = make_local_shards(full, sources)[0]
        want = {n: torch.zeros(s) for n, s in params.items()}
        execute_reference(plan, {0: shards}, {0: want})
        got = {n: torch.zeros(s) for n, s in params.items()}
        if sync == 3:  # a target of another layout: its message goes item by item, still exactly
            got["pa"] = torch.zeros(params["pa"][::-1]).t()
        staging = torch.empty(1 << 11, dtype=torch.uint8)
        plane = Loopback()
        run_rounds(plane, send, staging, sender=True, peer_rank=lambda w: 1 + w, dtypes=wire_dtypes,
                   tensor_of=lambda m, i, shards=shards: shards[m.items[i].name])
        run_rounds(Loopback({(SRC, tag): t for (_, tag), t in plane.wire.items()}), recv, torch.empty_like(staging),
                   sender=False, peer_rank=lambda r: r, dtypes=wire_dtypes,
                   tensor_of=lambda m, i, got=got: got[m.items[i].param])
        for n in params:
            assert torch.equal(got[n], want[n]), (sync, n)
        assert send.spans._of and recv.spans._of and send.spans._direct and recv.spans._direct
        assert send.spans._shape_list  # "d"'s box is no run of its shard: kept as a strided view's numbers
