"""How long trainer rank 0 waits for its client calls, and in which thread each runs.

Every blocking step of an init or a sync is bounded by the init info's ``timeout_s``: each store
read and data-plane wait (:mod:`weightsync.comm`), and each client call (``client_result``), which
runs in a thread so that the caller stops waiting when the time is up, whatever the client's own
timeout. Once a step failed, the clean-up (waiting for the client call in flight, aborting the
update on the workers) waits at most what is left of ``timeout_s`` since the init or sync began,
plus ``MARGIN_S`` for the abort; none for the abort while a client call is still running past its
wait (a worker is stuck: the abort, which goes to it too, is sent but not waited for). So a worker
that is alive but stuck makes trainer rank 0 raise within ``timeout_s`` of the step that waited for
it, and the other ranks as soon as rank 0 recorded the failure (docs/failures.md, "Bounded waits").
A call given up on goes on in its thread until the client returns; ``ClientCalls.drain`` (the
engine's shutdown) waits for those, at most ``timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ..comm import describe

__all__ = ["MARGIN_S", "ClientCalls", "client_result", "in_thread", "left", "settle"]

MARGIN_S = 2.0
"""What a failed step's abort (or a failed init's call) may wait beyond ``timeout_s`` since the sync
(init) began, when no client call is stuck."""


def client_result(fut: Future, timeout_s: float, what: str) -> Any:
    """The result of a client call running in a thread, within the timeout."""
    try:
        return fut.result(timeout=timeout_s)
    except FutureTimeout:
        raise TimeoutError(f"the client's {what} did not return within timeout_s={timeout_s}") from None


def left(t0: float, timeout_s: float, margin: float = 0.0) -> float:
    """Seconds from now until ``timeout_s`` after ``t0`` (``time.monotonic()``), or until now when that
    passed, plus ``margin``: how long a clean-up may still wait."""
    now = time.monotonic()
    return max(t0 + timeout_s, now) + margin - now


def settle(fut: Future, seconds: float) -> bool:
    """Wait at most ``seconds`` for ``fut`` to complete (its outcome is not raised): True when it did."""
    return bool(wait([fut], timeout=max(0.0, seconds)).done)


def in_thread(call: Callable[[], Any], name: str) -> Future:
    """``call()`` in a daemon thread of its own (one that never returns does not hold the process at
    exit); its future."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(call())
        except BaseException as e:  # noqa: BLE001 - the waiter gets it
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


class ClientCalls:
    """Rank 0's client calls, each in a thread: the engine's client thread, which runs them in order
    (a client without ``concurrent_calls`` must not be called from two threads at once), or, for a
    ``concurrent_calls`` client and ``aside=True``, a thread of the call's own, so that a finish or an
    abort never queues behind a call a stuck worker holds up. Tracks the calls still in flight."""

    def __init__(self, client: Any) -> None:
        self.concurrent = bool(getattr(client, "concurrent_calls", False))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-client")
        self._inflight: list[Future] = []

    def submit(self, call: Callable[[], Any], *, aside: bool = False) -> Future:
        """Run ``call`` in a client thread (see the class); its future."""
        fut = in_thread(call, "weightsync-client-aside") if aside and self.concurrent else self._pool.submit(call)
        self._inflight = [f for f in self._inflight if not f.done()] + [fut]
        return fut

    def watched(self, call: Callable[[], Any], what: str, comm: Any, wake: Sequence[str] = ()) -> Future:
        """``call`` in the client thread; its failure is recorded on the store (``comm``: a channel of
        the client thread's own) at once: every rank waiting there raises it. Once it returned, the
        ``wake`` keys no worker set are set as failed, before the future completes (a callback could
        run after the engine's ``_forget`` and set them again)."""
        wake = list(wake)

        def watched() -> Any:
            try:
                return call()
            except BaseException as e:
                comm.record(f"the client's {what} failed: {describe(e)}")
                raise
            finally:
                comm.fail_keys(wake)

        return self.submit(watched)

    def busy(self) -> bool:
        """Whether a call is still running (one given up on: a worker holds it up)."""
        return any(not f.done() for f in self._inflight)

    def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the calls in flight: a client call left running after a
        failure must not reach the engines after the next engine's calls. Then release the thread."""
        if self._inflight:
            wait(self._inflight, timeout=timeout_s)
        self._inflight = []
        self._pool.shutdown(wait=False)

    def shutdown(self, wait: bool = False) -> None:  # noqa: ARG002 - ThreadPoolExecutor's signature
        self._pool.shutdown(wait=False)
