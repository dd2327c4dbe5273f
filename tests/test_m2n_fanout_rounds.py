"""The executor's replica fan-out (``run_rounds(..., relay=Relay(...))``), every rank in its own thread
over an in-memory data plane matched by (sender, receiver, tag): 2 trainer ranks send replica 0's
plan only, each worker forwards every round it received to its children in the fan-out; every worker
of every replica ends with the reference executor's values, receives exactly its position's shard
bytes once, and the trainer ranks send the same bytes whatever the replica count."""

from __future__ import annotations

import threading

import pytest
import torch

from helpers import execute_reference, make_local_shards
from weightsync.errors import DataPlaneError
from weightsync.plan import DestPiece, Region, Shard, TensorSource, build_plan, mesh_coordinates, source_regions
from weightsync.plan.fanout import plan_fan_out
from weightsync.reshard.executor import Relay, run_rounds
from weightsync.reshard.handshake import my_messages

TRAINERS, TP = 2, 2
TIMEOUT_S = 60.0


class MemoryPlane:
    """One party's end: a send is copied out when posted (buffered), a receive filled at its wait
    from the matching send; a party that failed (``fail``) wakes every waiter with an error."""

    ordered = False

    def __init__(self, net: Net, rank: int) -> None:
        self.net, self.rank = net, rank
        self.sent = self.received = 0

    def post(self, sends, recvs):
        with self.net.cond:
            for t, peer, tag in sends:
                key = (self.rank, peer, tag)
                assert key not in self.net.wire, f"two sends with one tag {key}"
                self.net.wire[key] = t.clone()
                self.sent += t.nbytes
            self.net.cond.notify_all()
        return [("recv", t, peer, tag) for t, peer, tag in recvs]

    def wait_all(self, works, what=""):
        for _, t, peer, tag in works:
            key = (peer, self.rank, tag)
            with self.net.cond:
                if not self.net.cond.wait_for(lambda key=key: key in self.net.wire or self.net.failed, TIMEOUT_S):
                    raise DataPlaneError(f"{what}: timed out on rank {self.rank}")
                if key not in self.net.wire:
                    raise DataPlaneError(f"{what} failed on rank {self.rank}: a party failed: {self.net.failed}")
                got = self.net.wire.pop(key)
            assert got.nbytes == t.nbytes, (key, got.nbytes, t.nbytes)
            t.copy_(got)
            self.received += t.nbytes


class Net:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.wire: dict = {}
        self.failed: str | None = None

    def fail(self, who: str) -> None:
        with self.cond:
            self.failed = who
            self.cond.notify_all()


def _plan():
    """A row-sharded (2 trainer ranks) column-parallel weight, a row-parallel one (column slices:
    staged) and small norms (packed): the shapes of a TP 2 layer."""
    shapes = {"up": (64, 32), "down": (32, 64), "norm": (32,)}
    sources = [TensorSource(n, s, "float32", source_regions(s, (TRAINERS,), [Shard(0)], mesh_coordinates((TRAINERS,))))
               for n, s in shapes.items()]
    dests = [[DestPiece("up", Region((32 * p, 0), (32, 32)), "up", (0, 0)),
              DestPiece("down", Region((0, 32 * p), (32, 32)), "down", (0, 0)),
              DestPiece("norm", Region((0,), (32,)), "norm", (0,))] for p in range(TP)]
    params = {"up": (32, 32), "down": (32, 32), "norm": (32,)}
    return sources, build_plan(sources, dests), params


def _sync(replicas: int, mode: str, *, cap: int = 1024, kill: int | None = None, syncs: int = 1, fast=None):
    """``syncs`` syncs (new values each) over ``replicas`` replicas, each rank keeping its rounds across
    them; returns (trainer planes, worker planes, worker params, reference params per position of the
    last sync, errors per rank, plan). ``fast``: per worker, the syncs its rounds ran compiled."""
    sources, plan, shapes = _plan()
    fulls = [{s.name: torch.randn(s.shape) for s in sources} for _ in range(syncs)]
    shards = [make_local_shards(full, sources) for full in fulls]
    want = {p: {n: torch.zeros(s) for n, s in shapes.items()} for p in range(TP)}
    execute_reference(plan, shards[-1], want)
    fan = plan_fan_out(replicas, plan.coverage().lower_bound, chunk_bytes=cap, mode=mode)
    net, dtypes = Net(), {s.name: s.dtype for s in sources}
    planes = [MemoryPlane(net, r) for r in range(TRAINERS + replicas * TP)]
    got = [{n: torch.zeros(s) for n, s in shapes.items()} for _ in range(replicas * TP)]
    errors: dict[int, BaseException] = {}
    done = threading.Barrier(TRAINERS + replicas * TP, timeout=TIMEOUT_S)  # a sync ends before the next starts

    def trainer(r: int) -> None:
        rounds = my_messages(plan, sources, rank=r, sender=True, cap=cap)
        for k in range(syncs):
            run_rounds(planes[r], rounds, torch.empty(2 * cap * TP, dtype=torch.uint8), sender=True,
                       peer_rank=lambda w: TRAINERS + w, dtypes=dtypes,
                       tensor_of=lambda m, i, mine=shards[k][r]: mine[m.items[i].name])
            if k + 1 < syncs:
                done.wait()

    def worker(w: int) -> None:
        if w == kill:
            net.fail(f"worker {w}")
            raise DataPlaneError(f"worker {w} killed")
        parent = None if fan is None else fan.parent(w)
        children = () if fan is None else tuple(TRAINERS + c for c in fan.children(w))
        relay = None if fan is None else Relay(children, parent is not None, TRAINERS)
        rounds = my_messages(plan, sources, rank=w % TP, sender=False, cap=cap)
        staging = torch.empty(2 * cap * TRAINERS, dtype=torch.uint8)
        for k in range(syncs):
            if fast is not None and rounds.fast is not None:
                fast.setdefault(w, []).append(k)
            run_rounds(planes[TRAINERS + w], rounds, staging, sender=False,
                       peer_rank=(lambda r: r) if parent is None else (lambda r: TRAINERS + parent), dtypes=dtypes,
                       tensor_of=lambda m, i: got[w][m.items[i].param], relay=relay)
            if k + 1 < syncs:
                done.wait()

    def run(fn, rank, arg):
        try:
            fn(arg)
        except BaseException as e:  # noqa: BLE001 - collected for the test to assert
            errors[rank] = e
            net.fail(f"rank {rank}")

    threads = [threading.Thread(target=run, args=(trainer, r, r)) for r in range(TRAINERS)]
    threads += [threading.Thread(target=run, args=(worker, TRAINERS + w, w)) for w in range(replicas * TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
        assert not t.is_alive(), "a rank hung"
    return planes[:TRAINERS], planes[TRAINERS:], got, want, errors, plan


@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
@pytest.mark.parametrize("cap", [256, 4096], ids=["many-rounds", "few-rounds"])
def test_every_replica_gets_its_shard_once_and_trainers_send_one_replicas_worth(mode, cap):
    base, *_ = _sync(1, mode, cap=cap)
    one = [p.sent for p in base]
    assert all(one)
    for replicas in (2, 3, 4):
        trainers, workers, got, want, errors, plan = _sync(replicas, mode, cap=cap)
        assert errors == {}
        assert [p.sent for p in trainers] == one, replicas  # one replica's worth
        lower = plan.coverage().lower_bound
        assert [p.received for p in workers] == [lower[w % TP] for w in range(replicas * TP)]
        assert sum(p.sent for p in workers) == (replicas - 1) * sum(lower)  # each forward once
        for w in range(replicas * TP):
            for n, t in got[w].items():
                assert torch.equal(t, want[w % TP][n]), (replicas, w, n)


def test_a_failed_replica_wakes_everyone_below_it():
    """Chain 0 -> 1 -> 2 (one position each): replica 1's worker of position 0 fails; the worker below
    it raises DataPlaneError instead of hanging, so no replica behind a failed one applies a partial sync."""
    _, _, _, _, errors, _ = _sync(3, "chain", cap=256, kill=TP)
    assert isinstance(errors.get(TRAINERS + TP), DataPlaneError)
    assert isinstance(errors.get(TRAINERS + 2 * TP), DataPlaneError), errors


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_relays_later_dense_syncs_run_compiled_forward_the_same_bytes_and_stay_exact(mode):
    """Three dense syncs of new values through rounds each rank keeps: from the second one every worker,
    relays included, runs its compiled rounds (forwarding each part as it completes), every worker ends
    exact and receives its shard once per sync, and each forward goes once per sync."""
    replicas, syncs, fast = 3, 3, {}
    trainers, workers, got, want, errors, plan = _sync(replicas, mode, cap=256, syncs=syncs, fast=fast)
    assert errors == {}
    assert fast == {w: [1, 2] for w in range(replicas * TP)}  # (rounds compiled by the first sync)
    lower = plan.coverage().lower_bound
    assert [p.received for p in workers] == [syncs * lower[w % TP] for w in range(replicas * TP)]
    assert sum(p.sent for p in workers) == syncs * (replicas - 1) * sum(lower)
    for w in range(replicas * TP):
        for n, t in got[w].items():
            assert torch.equal(t, want[w % TP][n]), (w, n)
