"""``m2n_fast``: a dense sync over rounds kept as arrays is compiled for the next ones, which must
move exactly what the general path moves. 4 trainer ranks (dim-0 FSDP) -> 16 workers (TP 8 x 2
replicas), bf16 and fp32: dim-1 FSDP column slices at odd columns on both ends (``odd``: cols 7-8 of the
shard at col 6, into cols 1-2 of the param), norms every worker takes whole (one region to many messages: copied once,
then within the span), row-parallel column slices (strided, copied as integers of their element
width, batched), column-parallel rows and small pieces packed together; a replica's message equal to
another's is sent from the same span. Several
syncs of new values into new tensors give the reference's values on every worker, the same ops on
the same buffers' bytes as the general path, on planes that run ops in issue order or not; a tensor
of another layout, a checksum sync or another peer map runs the general path. Compiled, consecutive
thin rounds post as one (each peer's ops in the same order)."""

from __future__ import annotations

import pytest
import torch

from helpers import execute_reference, make_local_shards
from weightsync.plan import DestPiece, Region, Shard, TensorSource, build_plan, mesh_coordinates, source_regions
from weightsync.reshard import executor as m2n_rounds
from weightsync.reshard.executor import run_rounds
from weightsync.reshard.handshake import my_messages

RANKS, TP, REPLICAS = 4, 8, 2
SHAPES = {"norm": ((64,), "bfloat16"), "o": ((32, 16), "bfloat16"), "qkv": ((16, 16), "float32"),
          "small": ((8, 3), "bfloat16"), "tail": ((5,), "float32"), "odd": ((8, 24), "bfloat16")}


class Plane:
    """Sends complete when waited for (their bytes recorded per (src, dst, tag)); receives are
    filled from those records when waited for. ``log``: per post, its (peer, tag, bytes) ops."""

    def __init__(self, rank: int, sender: bool, wire: dict, *, ordered: bool) -> None:
        self.rank, self.sender, self.wire, self.ordered, self.log = rank, sender, wire, ordered, []

    def post(self, sends, recvs):
        ops = sends or recvs
        self.log.append([(peer, tag, t.numel()) for t, peer, tag in ops])
        return [(t, peer, tag) for t, peer, tag in ops]

    def wait_all(self, works, what=""):
        for t, peer, tag in works:
            if self.sender:
                self.wire[(self.rank, peer - RANKS, tag)] = t.clone()
            else:
                t.copy_(self.wire[(peer, self.rank, tag)])


def _plan():
    sources = [TensorSource(n, s, d, source_regions(s, (RANKS,), [Shard(int(n == "odd"))], mesh_coordinates((RANKS,))))
               for n, (s, d) in SHAPES.items()]
    c = 16 // TP
    per_tp = [[DestPiece("norm", Region((0,), (64,)), "norm", (0,)),
               DestPiece("o", Region((0, c * t), (32, c)), "o", (0, 0)),
               DestPiece("qkv", Region((c * t, 0), (c, 16)), "qkv", (0, 0)),
               DestPiece("small", Region((0, 0), (8, 3)), "small", (0, 0)),
               DestPiece("tail", Region((0,), (5,)), "tail", (0,)),
               DestPiece("odd", Region((0, 0), (8, 1)), "odd", (0, 0)),
               DestPiece("odd", Region((0, 7 + t % 2), (8, 2)), "odd", (0, 1)),
               DestPiece("odd", Region((0, 20), (8, 1)), "odd", (0, 3))] for t in range(TP)]
    params = {"norm": (64,), "o": (32, c), "qkv": (c, 16), "small": (8, 3), "tail": (5,), "odd": (8, 4)}
    return sources, build_plan(sources, [per_tp[t] for _ in range(REPLICAS) for t in range(TP)]), params


def _sync(plan, sources, params, send, recv, *, ordered, seed, sums=False):
    gen = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=gen).to(getattr(torch, d)) for n, (s, d) in SHAPES.items()}
    shards = make_local_shards(full, sources)
    dtype = {n: getattr(torch, d) for n, (_, d) in SHAPES.items()}
    want = {w: {p: torch.zeros(s, dtype=dtype[p]) for p, s in params.items()} for w in range(TP * REPLICAS)}
    execute_reference(plan, shards, want)
    got = {w: {p: torch.full(s, 7.0, dtype=dtype[p]) for p, s in params.items()} for w in want}
    wire, dtypes, planes = {}, {s.name: s.dtype for s in sources}, []
    for r in range(RANKS):
        planes.append(Plane(r, True, wire, ordered=ordered))
        run_rounds(planes[-1], send[r], torch.empty(1 << 12, dtype=torch.uint8), sender=True,
                   peer_rank=lambda w: RANKS + w, dtypes=dtypes, tensor_of=lambda m, i, r=r: shards[r][m.items[i].name],
                   sums={} if sums else None)
    for w in want:
        planes.append(Plane(w, False, wire, ordered=ordered))
        run_rounds(planes[-1], recv[w], torch.empty(1 << 12, dtype=torch.uint8), sender=False, peer_rank=lambda r: r,
                   dtypes=dtypes, tensor_of=lambda m, i, w=w: got[w][m.items[i].param], sums={} if sums else None)
        for p in params:
            assert torch.equal(got[w][p], want[w][p]), (seed, w, p)
    return [p.log for p in planes]


def _per_peer(log):
    """Each peer's ops in posting order: what both ends must agree on (rounds may merge)."""
    out = {}
    for post in log:
        for peer, tag, n in post:
            out.setdefault(peer, []).append((tag, n))
    return out


@pytest.mark.parametrize("cap", [512, 128], ids=["one-round", "thin-rounds"])
@pytest.mark.parametrize("ordered", [False, True], ids=["gloo", "nccl-ordered"])
def test_compiled_syncs_move_what_the_general_path_moves(ordered, cap, monkeypatch):
    sources, plan, params = _plan()
    cut = dict(cap=cap, alone=cap // 2)
    send = [my_messages(plan, sources, rank=r, sender=True, **cut) for r in range(RANKS)]
    recv = [my_messages(plan, sources, rank=w, sender=False, **cut) for w in range(TP * REPLICAS)]
    general = []
    real = m2n_rounds._Executor.run
    monkeypatch.setattr(m2n_rounds._Executor, "run", lambda self, rounds: general.append(1) or real(self, rounds))
    first = _sync(plan, sources, params, send, recv, ordered=ordered, seed=0)
    assert len(general) == RANKS + TP * REPLICAS and all(r.fast is not None for r in send + recv)
    assert all(r.kept_bytes() > r.compact.kept_bytes() + r.spans.nbytes() for r in send + recv)  # counted
    parts = [p for r in send for rnd in r.fast.rounds for p in rnd if p is not None]
    assert any(p.reps for p in parts) and any(p.batch_at for p in parts)  # the shapes this test is for
    assert any(b[3] > 1 for p in parts for b in p.batch_at)  # copied as integers of the element width
    assert any(len(set(v for v in p.vids if v < 0)) < sum(v < 0 for v in p.vids) for p in parts)  # a replica's
    for seed in (1, 2):
        logs = _sync(plan, sources, params, send, recv, ordered=ordered, seed=seed)
        assert [_per_peer(log) for log in logs] == [_per_peer(log) for log in first]
        assert all(len(log) <= len(was) for log, was in zip(logs, first))
    assert any(len(log) < len(was) for log, was in zip(logs, first)) == (cap == 128)  # thin rounds merged
    assert len(general) == RANKS + TP * REPLICAS  # the later syncs ran compiled
    _sync(plan, sources, params, send, recv, ordered=ordered, seed=3, sums=True)  # checksums: the general path
    assert len(general) == 2 * (RANKS + TP * REPLICAS)


def test_a_new_layout_runs_the_general_path_and_compiles_anew():
    sources, plan, params = _plan()
    send = [my_messages(plan, sources, rank=r, sender=True, cap=512, alone=256) for r in range(RANKS)]
    recv = [my_messages(plan, sources, rank=w, sender=False, cap=512, alone=256) for w in range(TP * REPLICAS)]
    _sync(plan, sources, params, send, recv, ordered=True, seed=0)
    before = recv[0].fast
    wire = {}
    shards = make_local_shards({n: torch.randn(s).to(getattr(torch, d)) for n, (s, d) in SHAPES.items()}, sources)
    for r in range(RANKS):
        run_rounds(Plane(r, True, wire, ordered=True), send[r], torch.empty(1 << 12, dtype=torch.uint8), sender=True,
                   peer_rank=lambda w: RANKS + w, dtypes={s.name: s.dtype for s in sources},
                   tensor_of=lambda m, i, r=r: shards[r][m.items[i].name])
    want = {p: torch.zeros(s, dtype=getattr(torch, SHAPES[p][1])) for p, s in params.items()}
    others = {w: {p: t.clone() for p, t in want.items()} for w in range(1, TP * REPLICAS)}
    execute_reference(plan, shards, {0: want, **others})
    got = {p: torch.zeros(s, dtype=want[p].dtype) for p, s in params.items()}
    got["o"] = torch.zeros(params["o"][::-1], dtype=torch.bfloat16).t()  # another layout: not contiguous
    run_rounds(Plane(0, False, wire, ordered=True), recv[0], torch.empty(1 << 12, dtype=torch.uint8), sender=False,
               peer_rank=lambda r: r, dtypes={s.name: s.dtype for s in sources},
               tensor_of=lambda m, i: got[m.items[i].param])
    for p in params:
        assert torch.equal(got[p], want[p]), p
    assert recv[0].fast is None or recv[0].fast is not before
