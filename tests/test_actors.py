"""The harness's actor processes: calls from several clients at once, failures that come back as
errors (never a hang), and a fan-out whose requests all go out before any reply is read."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from weightsync.testing.actors import Actor, ActorAddress, NotAwaited, RemoteError, _forget, call, call_many

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def actors():
    pair = [Actor("a0"), Actor("a1")]
    yield pair
    for a in pair:
        a.close()


def test_call_many_returns_each_actors_result_in_order(actors):
    pids = call_many([(a.address, "os:getpid", (), {}) for a in actors] * 2)
    assert pids == [a.process.pid for a in actors] * 2
    assert os.getpid() not in pids


def test_call_many_overlaps_the_calls(actors):
    """Two 0.5 s calls to two actors take ~0.5 s, not 1 s: both requests go out first."""
    started = time.monotonic()
    assert call_many([(a.address, "time:sleep", (0.5,), {}) for a in actors]) == [None, None]
    assert time.monotonic() - started < 0.9


def test_failures_come_back_per_call_and_the_actor_keeps_serving(actors):
    a0, a1 = actors
    out = call_many([(a0.address, "os:no_such_function", (), {}), (a1.address, "os:getpid", (), {}),
                     (a0.address, "threading:Lock", (), {})])  # a result that cannot be pickled
    assert isinstance(out[0], RemoteError) and "AttributeError" in str(out[0]) and "no_such_function" in str(out[0])
    assert out[1] == a1.process.pid
    assert isinstance(out[2], RemoteError) and "threading:Lock returned a result that could not be sent" in str(out[2])
    assert call(a0.address, "os:getpid") == a0.process.pid  # the same connections serve on


def test_a_call_times_out_and_the_next_one_is_answered(actors):
    a0 = actors[0]
    with pytest.raises(TimeoutError, match="time:sleep in actor a0 did not answer within 0.2s"):
        call(a0.address, "time:sleep", 1.0, timeout_s=0.2)
    assert call(a0.address, "os:getpid") == a0.process.pid  # queued behind the sleep, on a new connection


def test_calls_from_many_threads_at_once_lose_no_reply(actors):
    """64 threads each open fresh connections to both actors at once and every reply comes back.
    (With ``multiprocessing``'s listen backlog of 1, the kernel dropped handshakes under such a burst
    and 2 of 128 calls waited forever for an actor that never accepted them.)"""
    for a in actors:
        _forget(a.address)  # no idle connection to reuse: every call connects now
    results: list[object] = []
    timeout_s = 60.0

    def worker() -> None:
        results.extend(call_many([(a.address, "os:getpid", (), {}) for a in actors], timeout_s=timeout_s))

    # daemon: a hang fails, never blocks exit
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(64)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2 * timeout_s  # every call_many returns by its timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert [t for t in threads if t.is_alive()] == []
    lost = [r for r in results if not isinstance(r, int)]
    assert lost == [], f"{len(lost)} of {2 * 64} calls got no reply: {lost[:3]}"
    assert sorted(results) == sorted([a.process.pid for a in actors] * 64)


def test_a_silent_peer_fails_the_call_at_its_timeout_instead_of_hanging():
    """A peer that accepts the connection but never speaks (a lost handshake or reply): the call
    raises ``TimeoutError`` once its timeout has passed; no read of the harness waits unbounded."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        addr = ActorAddress("127.0.0.1", server.getsockname()[1], b"k" * 16, "silent")
        outcome: list[object] = []
        t0 = time.monotonic()
        thread = threading.Thread(target=lambda: outcome.extend(call_many([(addr, "os:getpid", (), {})],
                                                                          timeout_s=0.5)), daemon=True)
        thread.start()
        thread.join(30)
        elapsed = time.monotonic() - t0
        assert not thread.is_alive(), "the call hung on a silent peer"
        (error,) = outcome
        assert isinstance(error, TimeoutError) and str(error) == (
            "actor silent did not complete the handshake within 0.5s"), error
        assert elapsed >= 0.5  # it failed at its timeout, not before


def test_a_peer_that_stops_reading_fails_the_call_instead_of_blocking_its_write(monkeypatch):
    """A peer that authenticates, then never reads: a request larger than the socket buffers cannot
    be written; the write gives up once it made no progress for the harness's bound (here 0.5 s)."""
    from multiprocessing.connection import Listener

    import weightsync.testing.actors as actors_module

    monkeypatch.setattr(actors_module, "READ_BOUND_S", 0.5)
    with Listener(("127.0.0.1", 0), authkey=b"k" * 16) as listener:
        addr = ActorAddress(*listener.address, b"k" * 16, "deaf")
        held = []
        threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
        outcome: list[object] = []
        thread = threading.Thread(target=lambda: outcome.extend(call_many([(addr, "os:getpid", (b"x" * (64 << 20),),
                                                                            {})], timeout_s=30)), daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the write blocked on a peer that does not read"
        (error,) = outcome
        assert isinstance(error, BlockingIOError), error
        for conn in held:
            conn.close()


def test_a_silent_client_holds_up_no_other_connection(actors):
    a0 = actors[0]
    _forget(a0.address)
    with socket.create_connection((a0.address.host, a0.address.port)):  # connects, never authenticates
        assert call(a0.address, "os:getpid", timeout_s=30) == a0.process.pid


def test_a_dead_actor_is_an_error_for_its_call_only():
    dead, live = Actor("dead"), Actor("live")
    try:
        dead_addr = dead.address
        call(dead_addr, "os:getpid")  # a connection to it is kept idle
        dead.process.kill()
        dead.process.join(5)
        out = call_many([(dead_addr, "os:getpid", (), {}), (live.address, "os:getpid", (), {})])
        assert isinstance(out[0], (OSError, EOFError)), out[0]
        assert out[1] == live.process.pid
    finally:
        dead.close()
        live.close()


def test_fail_fast_stops_waiting_once_an_actor_dies_mid_call():
    """An actor that dies in its call fails the fan-out at once: the other, still in a 60 s call, is not
    waited for (its connection closed); without ``fail_fast`` the same fan-out would wait out the 60 s."""
    dying, busy = Actor("dying"), Actor("busy")
    try:
        started = time.monotonic()
        out = call_many([(dying.address, "os:_exit", (3,), {}), (busy.address, "time:sleep", (60,), {})],
                        fail_fast=True)
        assert time.monotonic() - started < 30
        assert isinstance(out[0], (OSError, EOFError)), out[0]
        assert isinstance(out[1], NotAwaited) and "time:sleep in actor busy" in str(out[1])
    finally:
        dying.close()
        busy.kill()  # (still in its call)
        busy.close()


def test_arguments_that_cannot_be_pickled_raise_and_the_actors_serve_on(actors):
    a0, a1 = actors
    with pytest.raises(Exception, match="pickle"):
        call_many([(a0.address, "os:getpid", (), {}), (a1.address, "builtins:repr", (lambda: 0,), {})])
    assert call_many([(a.address, "os:getpid", (), {}) for a in actors]) == [a.process.pid for a in actors]
