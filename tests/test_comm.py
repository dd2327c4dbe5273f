"""The sync group's channels, without vLLM: a failing party wakes every peer blocked on it, fast,
on gloo (CPU) and NCCL (CUDA, one GPU: every party on device 0; marked gpu, skipped without CUDA)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
import traceback
from typing import Any

import pytest
import torch

from weightsync.comm import Communicator
from weightsync.errors import DataPlaneError

WORLD = 3
TIMEOUT_S = 60.0
"""The parties' timeout_s: a failure or a key must wake a waiter well before it (in under half of it; the
bounds are relative to it, not tight seconds: the suite runs on loaded machines)."""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _party(rank: int, port: int, device: str, how: str, out: mp.Queue, done: Any) -> None:
    """Rank 0 fails after the others are blocked on it, and stays alive until the test has every report
    (``done``); the others report how they woke."""
    try:
        comm = Communicator.connect("127.0.0.1", port, name=f"party {rank}", timeout_s=TIMEOUT_S, host_store=rank == 0)
        comm.join(rank, WORLD, device=device)
        t = torch.zeros(1 << 16, device=device)
        if rank == 0:
            time.sleep(1.0)  # the others are blocked in their waits by now
            try:
                raise ValueError("the source yielded a wrong shape")
            except ValueError as e:
                comm.fail(f"{type(e).__name__}: {e}", e)
            out.put((rank, "failed", 0.0))
            done.wait(TIMEOUT_S)  # stays alive: peers must wake from the report, not from this process exiting
            return
        t0 = time.monotonic()
        try:
            if how == "broadcast":
                comm.data.wait_all([comm.data.broadcast(t, 0)], "broadcast")
            else:
                comm.data.exchange([], [(t, 0, 0)])
            out.put((rank, "completed", time.monotonic() - t0))
        except DataPlaneError as e:
            out.put((rank, str(e), time.monotonic() - t0))
    except Exception:  # noqa: BLE001 - reported to the test
        out.put((rank, traceback.format_exc(), -1.0))


def _run(device: str, how: str) -> dict[int, tuple[str, float]]:
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    port = _port()
    procs = [ctx.Process(target=_party, args=(r, port, device, how, out, done)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(WORLD):
        rank, what, seconds = out.get(timeout=120)
        results[rank] = (what, seconds)
    done.set()
    for p in procs:
        p.join(30)
    return results


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA], ids=["gloo", "nccl"])
@pytest.mark.parametrize("how", ["broadcast", "recv"])
def test_a_failing_party_wakes_every_blocked_peer_with_its_reason(device, how):
    results = _run(device, how)
    assert results[0][0] == "failed"
    for rank in (1, 2):
        what, seconds = results[rank]
        assert "party 0: ValueError: the source yielded a wrong shape" in what, what
        assert 0 < seconds < TIMEOUT_S / 2, (rank, seconds)  # well before the timeout (rank 0 is alive)


def test_store_reads_raise_a_reported_failure_at_once_and_name_the_key_on_timeout():
    host = Communicator.connect("127.0.0.1", 0, name="trainer rank 0", timeout_s=TIMEOUT_S, host_store=True)
    peer = Communicator.connect("127.0.0.1", host.port, name="worker 0", timeout_s=TIMEOUT_S)
    with pytest.raises(DataPlaneError, match=r"timed out after 0.2s on worker 0 waiting for 'nothing'"):
        peer.read("nothing", timeout_s=0.2)
    host.fail("RuntimeError: boom")
    host.fail("RuntimeError: a later failure")  # the first report wins
    t0 = time.monotonic()
    with pytest.raises(DataPlaneError, match="a party failed: trainer rank 0: RuntimeError: boom$"):
        peer.read("nothing")
    assert time.monotonic() - t0 < TIMEOUT_S / 2
    peer.shutdown()
    host.shutdown()


def test_read_all_waits_for_every_key_and_raises_a_failure_or_names_the_keys_not_set():
    host = Communicator.connect("127.0.0.1", 0, name="trainer rank 0", timeout_s=TIMEOUT_S, host_store=True)
    peer = Communicator.connect("127.0.0.1", host.port, name="trainer rank 1", timeout_s=TIMEOUT_S)
    host.publish("sync1/preflight/0", "")
    threading.Timer(0.3, host.publish, ("sync1/preflight/2", {"rank": 2, "error": "x"})).start()
    t0 = time.monotonic()
    assert peer.read_all(["sync1/preflight/0", "sync1/preflight/2"]) == ["", {"rank": 2, "error": "x"}]
    assert 0.25 < time.monotonic() - t0 < TIMEOUT_S / 2  # it waited for the last key
    with pytest.raises(DataPlaneError, match=r"timed out after 0.2s on trainer rank 1 waiting for 'sync1/sent/2' "
                       r"\(and 1 more\)"):
        peer.read_all(["sync1/preflight/0", "sync1/sent/2", "sync1/sent/3"], timeout_s=0.2)
    threading.Timer(0.3, host.fail, ("RuntimeError: boom",)).start()
    t0 = time.monotonic()
    with pytest.raises(DataPlaneError, match="a party failed: trainer rank 0: RuntimeError: boom$"):
        peer.read_all(["sync1/preflight/0", "sync1/sent/2"])
    assert time.monotonic() - t0 < TIMEOUT_S / 2
    peer.shutdown()
    host.shutdown()


def test_await_key_wakes_when_the_key_is_set_or_a_party_marks_it_failed():
    host = Communicator.connect("127.0.0.1", 0, name="trainer rank 0", timeout_s=TIMEOUT_S, host_store=True)
    peer = Communicator.connect("127.0.0.1", host.port, name="trainer rank 1", timeout_s=TIMEOUT_S)
    later = threading.Timer(0.3, host.publish, ("sync1/verdict", "ok"))
    later.start()
    t0 = time.monotonic()
    assert peer.await_key("sync1/verdict") == "ok"
    assert 0.25 < time.monotonic() - t0 < TIMEOUT_S / 2  # it waited for the key
    host.fail_keys(["sync1/verdict"])  # a value already set stays
    assert peer.await_key("sync1/verdict") == "ok"

    def failing() -> None:
        host.fail("RuntimeError: a worker refused the update")
        host.fail_keys(["sync2/started", "sync2/verdict"])

    threading.Timer(0.3, failing).start()
    t0 = time.monotonic()
    with pytest.raises(DataPlaneError, match="a party failed: trainer rank 0: RuntimeError: a worker refused"):
        peer.await_key("sync2/started")
    assert time.monotonic() - t0 < TIMEOUT_S / 2
    with pytest.raises(DataPlaneError, match="a party failed"):
        peer.await_key("sync2/verdict")
    host.shutdown()  # the store's host is gone: a waiter raises at once, naming the key
    t0 = time.monotonic()
    with pytest.raises(DataPlaneError, match="store is unreachable while waiting for 'sync3/verdict'"):
        peer.await_key("sync3/verdict")
    assert time.monotonic() - t0 < TIMEOUT_S / 2
    peer.shutdown()


def test_await_key_names_the_key_on_timeout():
    host = Communicator.connect("127.0.0.1", 0, name="trainer rank 0", timeout_s=0.3, host_store=True)
    peer = Communicator.connect("127.0.0.1", host.port, name="trainer rank 1", timeout_s=0.3)
    with pytest.raises(DataPlaneError, match=r"timed out after 0.3s on trainer rank 1 waiting for 'sync1/started'"):
        peer.await_key("sync1/started")
    peer.shutdown()
    host.shutdown()


def test_await_keys_returns_every_value_once_all_are_set_and_a_second_channel_reaches_the_store_meanwhile():
    host = Communicator.connect("127.0.0.1", 0, name="trainer rank 0", timeout_s=TIMEOUT_S, host_store=True)
    side = host.second_channel()  # what rank 0's client thread uses while rank 0 blocks on the store
    worker = Communicator.connect("127.0.0.1", host.port, name="worker 1", timeout_s=TIMEOUT_S)
    host.publish("sync1/recv/0", 10)
    threading.Timer(0.3, worker.publish, ("sync1/recv/1", 20)).start()
    t0 = time.monotonic()
    assert host.await_keys(["sync1/recv/0", "sync1/recv/1"]) == [10, 20]
    assert 0.25 < time.monotonic() - t0 < TIMEOUT_S / 2  # it waited for the key

    def update_returned() -> None:  # worker 1 reported a failure and never set its key
        side.record("worker 1: ValueError: verify: checksums differ")
        side.fail_keys(["sync2/recv/0", "sync2/recv/1"])

    host.publish("sync2/recv/0", 10)
    threading.Timer(0.3, update_returned).start()
    t0 = time.monotonic()
    with pytest.raises(DataPlaneError, match="a party failed: trainer rank 0: worker 1: ValueError: verify"):
        host.await_keys(["sync2/recv/0", "sync2/recv/1"])
    assert time.monotonic() - t0 < TIMEOUT_S / 2
    for c in (worker, side, host):
        c.shutdown()


def test_a_rank_reinitializing_on_a_fixed_port_connects_to_the_new_store_only():
    """Trainer rank > 0 re-initializing on the same master_port: a store it left is the previous init's (it
    waits until rank 0 closed it), and one that closed while it connected is tried again (the CI race: rank 1
    failed its init with "connection closed" while rank 0 waited 20 s for its metadata digest)."""
    from weightsync.control import trainer_left
    from weightsync.sealed import StoreClosed
    from weightsync.trainer.session import connect_fresh, leave

    old = Communicator.connect("127.0.0.1", 0, name="old host", timeout_s=30, host_store=True)
    port = old.port
    left = Communicator.connect("127.0.0.1", port, name="rank 1", timeout_s=30)
    leave(left, 1)
    left.shutdown()
    closer = threading.Thread(target=old.shutdown)  # rank 0 closes the old store while rank 1 waits in it
    hosts: list[Communicator | None] = []  # per try: the store rank 0 opened for it

    def connect() -> Communicator:
        hosts.append(None)
        if len(hosts) == 2:  # the old store closes while this rank connects
            raise StoreClosed("the sync group's store closed the connection")
        if len(hosts) == 3:  # rank 0's new store, on the same port
            closer.join()
            hosts[-1] = Communicator.connect("127.0.0.1", port, name="new host", timeout_s=30, host_store=True)
            hosts[-1].publish("which", "new")
        comm = Communicator.connect("127.0.0.1", port, name="rank 1", timeout_s=30)
        if len(hosts) == 1:
            closer.start()
        return comm

    comm = connect_fresh(connect, 1, timeout_s=60)
    try:
        assert len(hosts) == 3 and comm.read("which") == "new" and comm.peek(trainer_left(1)) is None
    finally:
        comm.shutdown()
        assert hosts[-1] is not None
        hosts[-1].shutdown()


def test_a_party_told_the_store_is_hosted_fails_at_once_when_nothing_listens_there():
    """A worker connects only once its trainer hosted the store (``hosted=True``): a refused connection
    means the store is gone (the trainer's init failed, or it shut down), so connecting, and reporting a
    failure there, raise ``StoreClosed`` naming the address at once instead of retrying for ``timeout_s``;
    while the store is up the same call connects."""
    from weightsync.sealed import StoreClosed

    host = Communicator.connect("127.0.0.1", 0, name="host", timeout_s=TIMEOUT_S, host_store=True)
    port = host.port
    client = Communicator.connect("127.0.0.1", port, name="worker", timeout_s=TIMEOUT_S, hosted=True)
    client.publish("k", 1)
    assert host.read("k") == 1
    client.shutdown()
    host.shutdown()
    for attempt in (lambda: Communicator.connect("127.0.0.1", port, name="worker", timeout_s=TIMEOUT_S, hosted=True),
                    lambda: Communicator.report("127.0.0.1", port, "worker 0: failed", timeout_s=TIMEOUT_S)):
        t0 = time.monotonic()
        with pytest.raises(StoreClosed, match=f"store at 127.0.0.1:{port} refused the connection: nothing listens"):
            attempt()
        assert time.monotonic() - t0 < TIMEOUT_S / 4
