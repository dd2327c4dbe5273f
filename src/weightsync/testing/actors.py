"""Long-lived local worker processes ("actors") that run named functions on request.

Each actor is a Python process listening on a loopback socket (authkey-protected,
``multiprocessing.connection``); any process holding its address can call
``module:function`` in it. Calls run one at a time on the actor's main thread; objects a call
wants to keep (a model, an engine) go into ``STATE``. Used by the CPU demo and the tests: each
vLLM process costs seconds to import, so actors fork from a server that imported it once
(``testing.preload``), and are started once and reused.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import queue
import secrets
import socket
import struct
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import AuthenticationError, forkserver
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, cast

__all__ = ["STATE", "ActorAddress", "Actor", "call", "call_many", "NotAwaited", "RemoteError"]

STATE: dict[str, Any] = {}
"""Per-process storage for what calls keep between calls."""


class RemoteError(RuntimeError):
    """A call raised in an actor; the message holds the remote exception and traceback."""


@dataclass(frozen=True)
class ActorAddress:
    host: str
    port: int
    authkey: bytes
    name: str


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (0 when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A port free on 127.0.0.1 now and not handed out before by this process. It is drawn at random
    below the kernel's ephemeral range where there is room: a port the OS hands out (an outgoing
    connection's, a port-0 listener's) could otherwise take it between this check and its user's bind."""
    low = _ephemeral_low()
    first = 20000 if low > 24000 else low // 2  # (Ray's workers take 10002-19999)
    for attempt in range(1000):
        port = first + secrets.randbelow(low - first) if low >= 4096 and attempt < 999 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port on 127.0.0.1")


def _resolve(fn: str) -> Any:
    module, _, attr = fn.partition(":")
    return getattr(importlib.import_module(module), attr)


READ_BOUND_S = 120.0
"""The longest any socket read or write of the harness waits for progress (handshakes, requests,
replies): a peer that went silent fails its call with an ``OSError`` instead of hanging. A reply is
waited for at most the call's ``timeout_s`` (always given: no call waits without a limit)."""
BACKLOG = 128
"""The actors' listen backlog. (``multiprocessing``'s default of 1 overflowed when 16 calls connected
at once on a loaded machine: the kernel dropped handshakes, and clients waited forever on a
connection the actor never accepted.)"""


def _bound_reads(sock: socket.socket | Connection, seconds: float) -> None:
    """Make every blocking read and write of ``sock`` give up after ``seconds`` without progress
    (``SO_RCVTIMEO``, ``SO_SNDTIMEO``: the socket stays blocking, a read or write that waits longer
    raises ``BlockingIOError``; a write waits for a peer that does not read)."""
    usec = max(1000, int(seconds * 1e6))
    value = struct.pack("ll", usec // 1_000_000, usec % 1_000_000)
    with (socket.socket(fileno=os.dup(sock.fileno())) if isinstance(sock, Connection)  # options belong to
          else contextlib.nullcontext(sock)) as s:  # the socket, not the fd
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            s.setsockopt(socket.SOL_SOCKET, option, value)


def _client(addr: ActorAddress, bound_s: float = READ_BOUND_S) -> Connection:
    """``multiprocessing.connection.Client`` with ``TCP_NODELAY`` (each call's small messages would
    otherwise wait for delayed ACKs, ~40 ms a call); connecting and authenticating take at most
    ``bound_s``, and every later read waits at most ``READ_BOUND_S`` for a byte."""
    sock = socket.create_connection((addr.host, addr.port), timeout=bound_s)
    sock.settimeout(None)  # blocking again; reads are bounded by SO_RCVTIMEO
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _bound_reads(sock, bound_s)
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, addr.authkey)
        deliver_challenge(conn, addr.authkey)
    except BlockingIOError:
        conn.close()
        raise TimeoutError(f"actor {addr.name} did not complete the handshake within {bound_s:.3g}s") from None
    except BaseException:
        conn.close()
        raise
    _bound_reads(conn, READ_BOUND_S)
    return conn


_IDLE: dict[ActorAddress, list[Connection]] = {}
"""Open connections not in use, per actor (a call takes one, or opens one, and puts it back)."""
_IDLE_LOCK = threading.Lock()
_IDLE_PID = os.getpid()


def _take(addr: ActorAddress, bound_s: float = READ_BOUND_S) -> Connection:
    global _IDLE_PID
    with _IDLE_LOCK:
        if _IDLE_PID != os.getpid():  # a forked child must not share its parent's sockets
            _IDLE.clear()
            _IDLE_PID = os.getpid()
        idle = _IDLE.get(addr)
        if idle:
            return idle.pop()
    return _client(addr, bound_s)


def _forget(addr: ActorAddress) -> None:
    """Close the idle connections to an actor that is going away."""
    with _IDLE_LOCK:
        conns = _IDLE.pop(addr, [])
    for conn in conns:
        conn.close()


def call(addr: ActorAddress, fn: str, *args: Any, timeout_s: float = 600.0, **kwargs: Any) -> Any:
    """Run ``fn`` (``"module:function"``) in the actor at ``addr`` and return its result. The
    connection is kept for the next call (an actor serves each connection until it closes), so a
    call costs one request and one reply; one that failed on the wire or timed out is closed."""
    (outcome,) = call_many([(addr, fn, args, kwargs)], timeout_s=timeout_s)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def call_many(calls: list[tuple[ActorAddress, str, tuple[Any, ...], dict[str, Any]]], *,
              timeout_s: float = 600.0, fail_fast: bool = False) -> list[Any]:
    """Run every ``(addr, fn, args, kwargs)`` call at once from this thread: each request goes out
    before any reply is read. Returns per call its result, or the exception it raised
    (``RemoteError``, ``TimeoutError`` after ``timeout_s`` in all, ``OSError``, ``EOFError``).

    ``fail_fast``: once an actor is lost (its connection broke), the calls still running are not
    waited for, as vLLM's executor fails every call once a worker process died: their outcome is
    :class:`NotAwaited` (their connections are closed; the calls themselves run to their end)."""
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:  # (None would wait forever)
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    out: list[Any] = [None] * len(calls)
    pending: dict[Connection, int] = {}
    for k, (addr, fn, args, kwargs) in enumerate(calls):
        conn = None
        try:
            conn = _take(addr, min(READ_BOUND_S, max(0.001, deadline - time.monotonic())))
            conn.send((fn, args, kwargs))
            pending[conn] = k
        except (OSError, EOFError) as e:  # this call failed on the wire; the others go on
            if conn is not None:
                conn.close()
            out[k] = e
        except BaseException:  # e.g. arguments that cannot be pickled: no call is made
            for c in [conn, *pending]:
                if c is not None:
                    c.close()  # their replies are not read
            raise
    lost = fail_fast and any(isinstance(o, BaseException) for o in out)
    try:
        while pending and not lost:
            lost = _read_replies(calls, pending, out, deadline, timeout_s) and fail_fast
    except BaseException:
        for c in pending:
            c.close()
        raise
    for conn, k in pending.items():
        conn.close()
        out[k] = NotAwaited(f"{calls[k][1]} in actor {calls[k][0].name} was not waited for: another actor was lost")
    return out


class NotAwaited(RuntimeError):
    """A call of :func:`call_many` with ``fail_fast`` whose reply was not waited for."""


def _read_replies(calls: list[tuple[ActorAddress, str, tuple[Any, ...], dict[str, Any]]],
                  pending: dict[Connection, int], out: list[Any], deadline: float, timeout_s: float) -> bool:
    """Read the replies that arrived (waiting for one until ``deadline``) into ``out``; True when a
    connection was lost or the deadline passed."""
    ready = wait(list(pending), max(0.0, deadline - time.monotonic()))
    if not ready:
        for conn, k in pending.items():
            conn.close()
            out[k] = TimeoutError(f"{calls[k][1]} in actor {calls[k][0].name} did not answer within {timeout_s}s")
        pending.clear()
        return True
    lost = False
    for conn in cast("list[Connection]", ready):
        k = pending.pop(conn)
        addr, fn = calls[k][0], calls[k][1]
        try:
            status, value = conn.recv()
        except (OSError, EOFError) as e:
            conn.close()
            out[k], lost = e, True
            continue
        except BaseException:
            conn.close()
            raise
        with _IDLE_LOCK:
            _IDLE.setdefault(addr, []).append(conn)
        out[k] = value if status == "ok" else RemoteError(f"{fn} in actor {addr.name} failed: {value}")
    return lost


def _actor_main(name: str, env: dict[str, str], ready: Any) -> None:
    """Serve calls on the main thread: it waits on every open connection at once and answers each
    request in place (no hand-off between threads per call). A thread accepts and authenticates new
    connections and wakes the main thread to add them."""
    os.environ.update(env)
    authkey = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), backlog=BACKLOG)  # authenticated per connection below
    listener._listener._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
    accepted: queue.SimpleQueue[Connection] = queue.SimpleQueue()
    wake_recv, wake_send = mp.Pipe(duplex=False)
    wake_lock = threading.Lock()

    def handshake(conn: Connection) -> None:
        """Authenticate one connection (its own thread: a silent client holds up no other)."""
        try:
            _bound_reads(conn, READ_BOUND_S)
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        except (AuthenticationError, OSError, EOFError):
            conn.close()  # a client that failed the handshake, went away or went silent
            return
        accepted.put(conn)
        with wake_lock:
            wake_send.send_bytes(b"")

    def accept_loop() -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:
                continue
            threading.Thread(target=handshake, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    host, port = listener.address
    ready.send(ActorAddress(host, port, authkey, name))
    ready.close()
    conns: list[Connection] = []
    while True:
        for conn in wait([wake_recv, *conns]):
            if conn is wake_recv:
                wake_recv.recv_bytes()
                while not accepted.empty():
                    conns.append(accepted.get())
                continue
            if not _answer(conn):
                conns.remove(conn)
                conn.close()


def _answer(conn: Connection) -> bool:
    """Read one request from ``conn``, run it, send the reply; False once the connection is gone."""
    try:
        fn, args, kwargs = conn.recv()
    except (EOFError, OSError):
        return False
    except Exception as e:  # noqa: BLE001 - a request this process cannot unpickle
        fn, reply = None, ("err", f"the request could not be read: {type(e).__name__}: {e}")
    if fn == "__exit__":
        conn.send(("ok", None))
        os._exit(0)  # skips seconds of native teardown (vLLM, gloo)
    if fn is not None:
        try:
            reply = ("ok", _resolve(fn)(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            reply = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        payload = ForkingPickler.dumps(reply)
    except Exception as e:  # noqa: BLE001 - a result that cannot be pickled
        payload = ForkingPickler.dumps(
            ("err", f"{fn} returned a result that could not be sent: {type(e).__name__}: {e}"))
    try:
        conn.send_bytes(payload)
    except (OSError, EOFError):  # the caller went away (broken pipe, reset)
        return False
    return True


_SERVER_LOCK = threading.Lock()


def _context() -> Any:
    """Actors fork from one server process that imported what they all import (``testing.preload``):
    an actor starts in a fraction of a second instead of importing torch and vLLM again. The server
    (re)starts with this process's environment and ``OMP_NUM_THREADS=1``, as every actor runs: OpenMP
    then starts no thread in it (a process with threads must not fork). An actor has the environment
    this process had when the server started, plus its own ``env``."""
    ctx = mp.get_context("forkserver")
    with _SERVER_LOCK:
        ctx.set_forkserver_preload(["weightsync.testing.preload"])
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
    return ctx


class Actor:
    """Parent-side handle: starts the process and calls into it."""

    def __init__(self, name: str, env: dict[str, str] | None = None) -> None:
        ctx = _context()
        parent, child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_actor_main, args=(name, dict(env or {}), child), daemon=True, name=name)
        self.process.start()
        child.close()
        self._ready, self.name = parent, name
        self._address: ActorAddress | None = None
        self._pool = ThreadPoolExecutor(1)

    @property
    def address(self) -> ActorAddress:
        """The actor's address; waits for the process to come up (started in ``__init__``)."""
        if self._address is None:
            if not self._ready.poll(120):
                self.process.kill()
                raise RuntimeError(f"actor {self.name} did not start within 120 s")
            self._address = self._ready.recv()
        return self._address

    def call(self, fn: str, *args: Any, timeout_s: float = 600.0, **kwargs: Any) -> Any:
        return call(self.address, fn, *args, timeout_s=timeout_s, **kwargs)

    def submit(self, fn: str, *args: Any, timeout_s: float = 600.0, **kwargs: Any) -> Future:
        return self._pool.submit(self.call, fn, *args, timeout_s=timeout_s, **kwargs)

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        if self._address is not None:
            _forget(self._address)
        self.process.kill()
        self.process.join(5)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("__exit__", timeout_s=5)
            except Exception:  # noqa: BLE001 - it is going away anyway
                pass
            self.process.join(5)
            if self.process.is_alive():
                self.kill()
        if self._address is not None:
            _forget(self._address)
        self._pool.shutdown(wait=False)


def gather(futures: list[Future]) -> list[Any]:
    """Results of ``futures`` in order; the first failure is raised after all have finished."""
    results, first_error = [], None
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as e:  # noqa: BLE001
            first_error = first_error or e
            results.append(None)
    if first_error is not None:
        raise first_error
    return results
