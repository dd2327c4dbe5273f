"""The store sealed with a shared secret: a party without it can neither join a sync group nor read it.

TCPStore itself is unauthenticated: anyone who reaches its port can list, read and write every key.
With a secret set (``WEIGHTSYNC_STORE_SECRET``, or ``secret=`` to :meth:`Communicator.connect`; at
least 32 bytes), every party talks to the store through :class:`SealedStore`. The cryptography is
``cryptography``'s (HKDF-SHA256, HMAC-SHA256, AES-256-GCM); nothing here is hand-written.

Keys per group. The store's host draws a random 16-byte group id for every group it hosts and
publishes it in plain (``weightsync/group``). Every party derives the group's keys from the secret
with HKDF (salt = group id, info = the key's purpose): one that names keys, one that seals values.
A value recorded in one group therefore opens in no other group sharing the secret: not in a
second live group, not after a re-init on the same port (a new group id).

- Every key name on the wire is ``HMAC-SHA256(name key, name)`` (hex): ``list_keys`` and a raw
  client see only opaque names, different in every group.
- Every value is sealed with AES-GCM under a fresh random 96-bit nonce, with the key name and the
  value's write counter as associated data: a value cannot be moved to another key, and a value
  that fails authentication raises :class:`ForgedValueError` naming the key.

Write counters (rewrites of one key). Every write of a key takes the next number of that key's
counter, an atomic ``add`` on the store (under a sealed name of its own), so the writes of one key
are numbered 1, 2, 3, ... whoever writes them (two channels of one process, or two processes),
and the number is sealed into the value. Every reader keeps the highest number it has opened
for each key (:attr:`SealedStore.seen`) and refuses a value numbered lower: a value that was
rewritten cannot be put back for a reader that saw its successor (``held`` 3 -> None -> 3 is
refused, naming the key). An attacker who lowers the counter gains nothing: the next write then
carries a number its readers refuse (a denial of service, as deleting a key is). What this cannot
give: a reader that never opened the newer value cannot tell the older one from it (the store is
not trusted to say which is the latest); weightsync's keys are per sync (``sync<id>/...``) and
written once, except the workers' ``held`` keys (a worker re-publishing what it holds).

The data plane's rendezvous (gloo's and NCCL's, through ``PrefixStore``) goes through the same
sealed store, so the peers' addresses and NCCL's unique id are sealed too. Counters (``add``) are
not encrypted: they live under sealed names with plain integer values (weightsync's own: the write
counters above; torch's rendezvous may add some).

What it does not do: a client without the secret can still delete or overwrite keys it has seen
(a denial of service: the sync then fails with ``ForgedValueError`` or times out, it never applies
forged data). See docs/security.md.
"""

from __future__ import annotations

import errno
import hmac
import os
import socket
from collections import OrderedDict
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import DataPlaneError

__all__ = ["MIN_SECRET_BYTES", "SECRET_ENV", "ForgedValueError", "StoreClosed", "SealedStore", "group_keys",
           "listen_socket", "loopback_store", "open_store", "store_secret"]

SECRET_ENV = "WEIGHTSYNC_STORE_SECRET"
"""The environment variable every party reads the shared secret from (unset or empty: no secret)."""
MIN_SECRET_BYTES = 32
"""The shortest secret accepted: 32 bytes (a 256-bit key's worth when random)."""
_MAKE_ONE = "python -c \"import secrets; print(secrets.token_hex(32))\""
_MAGIC = b"WS2"
_COUNTER = 8  # bytes of the write counter, big-endian, after the magic
_NONCE = 12
_TAG = 16
_HEAD = len(_MAGIC) + _COUNTER + _NONCE
_SEEN_LIMIT = 1 << 16
"""Keys whose highest write counter a reader remembers (least recently opened forgotten first)."""
_MARKER = "weightsync/store"
"""Set by the host, unsealed: ``open`` or ``sealed``, so that a party whose secret setting differs
from the host's gets a clear error at connect instead of waiting out its timeout."""
_GROUP = "weightsync/group"
"""Set by the host of a sealed store, unsealed: the group id (hex), the salt of the group's keys."""
_CHECK = "weightsync/check"
"""A sealed value the host sets under this plain name: a client whose secret is not the group's fails
to open it."""


class ForgedValueError(DataPlaneError):
    """A store value failed authentication: set by a party without the group's secret, recorded in
    another group or before a rewrite of its key, or corrupted."""


class StoreClosed(DataPlaneError):
    """The store closed the connection while a client connected (e.g. the previous init's store, which
    trainer rank 0 was closing on the same port)."""


def store_secret(secret: str | bytes | None = None) -> bytes | None:
    """The shared secret to use: ``secret`` if given, else ``$WEIGHTSYNC_STORE_SECRET``; None when
    neither is set (an empty value counts as unset). A secret shorter than ``MIN_SECRET_BYTES`` is
    refused (``ValueError`` saying how to make one)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV, "")
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise ValueError(f"the store secret must be str or bytes, got {type(secret).__name__}")
    if secret and len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the store secret ({SECRET_ENV} or secret=) must be at least {MIN_SECRET_BYTES} bytes, "
                         f"got {len(secret)}: make one with {_MAKE_ONE}")
    return secret or None


def group_keys(secret: bytes, group_id: bytes) -> tuple[bytes, bytes]:
    """The group's (name key, value key): HKDF-SHA256 of ``secret`` with salt ``group_id``."""
    def derive(purpose: bytes) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=group_id, info=purpose).derive(secret)
    return derive(b"weightsync/store names"), derive(b"weightsync/store values")


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SealedStore(dist.Store):
    """A c10d ``Store`` over ``inner`` whose key names and values are sealed with the keys of group
    ``group_id`` (:func:`group_keys`; see the module docstring).

    Usable wherever torch takes a store (``PrefixStore``, ``ProcessGroupGloo``/``NCCL``).
    ``compare_set`` supports only what weightsync uses: an expected value that is empty ("set if
    missing") or a never-published sentinel ("read if set"), passed through unsealed."""

    def __init__(self, inner: Any, secret: bytes, group_id: bytes) -> None:
        super().__init__()
        self.inner = inner
        self.group_id = group_id
        self._name_key, value_key = group_keys(secret, group_id)
        self._aead = AESGCM(value_key)
        self.seen: OrderedDict[str, int] = OrderedDict()
        """Key -> the highest write counter this party opened under it (a lower one is refused)."""

    @property
    def host(self) -> str:
        return self.inner.host

    @property
    def port(self) -> int:
        return int(self.inner.port)

    def name(self, key: str) -> str:
        """The key's name on the wire: ``HMAC(name key, key)``, hex."""
        return "ws/" + hmac.new(self._name_key, key.encode(), "sha256").hexdigest()

    def _counter_name(self, key: str) -> str:
        return "ws/" + hmac.new(self._name_key, b"\x00counter\x00" + key.encode(), "sha256").hexdigest()

    @staticmethod
    def _aad(key: str, counter: bytes) -> bytes:
        return b"weightsync/value\x00" + key.encode() + b"\x00" + counter

    def seal(self, key: str, value: bytes | str, counter: int) -> bytes:
        """``value`` encrypted and authenticated for ``key`` as its write number ``counter``."""
        ctr, nonce = counter.to_bytes(_COUNTER, "big", signed=True), os.urandom(_NONCE)
        return _MAGIC + ctr + nonce + self._aead.encrypt(nonce, _bytes(value), self._aad(key, ctr))

    def open(self, key: str, blob: bytes) -> bytes:
        """``blob``'s plaintext; ``ForgedValueError`` naming ``key`` when it fails authentication
        (another group's value, another key's, a forgery) or is older than one opened before."""
        blob = bytes(blob)
        if len(blob) < _HEAD + _TAG or not blob.startswith(_MAGIC):
            raise ForgedValueError(f"forged value rejected under store key {key!r}: not sealed with this "
                                   f"group's secret ({len(blob)} bytes)")
        ctr, nonce = blob[len(_MAGIC):len(_MAGIC) + _COUNTER], blob[len(_MAGIC) + _COUNTER:_HEAD]
        try:
            plain = self._aead.decrypt(nonce, blob[_HEAD:], self._aad(key, ctr))
        except InvalidTag:
            raise ForgedValueError(f"forged value rejected under store key {key!r}: it was not sealed for this key "
                                   "in this group (another group's or another key's value, or a forgery)") from None
        counter = int.from_bytes(ctr, "big", signed=True)
        last = self.seen.get(key, counter)
        if counter < last:
            raise ForgedValueError(f"replayed value rejected under store key {key!r}: write {counter} of the key, "
                                   f"but this party already read write {last}")
        self.seen[key] = counter
        self.seen.move_to_end(key)
        if len(self.seen) > _SEEN_LIMIT:
            self.seen.popitem(last=False)
        return plain

    def _sealed(self, key: str, value: Any) -> bytes:
        """``value`` sealed as ``key``'s next write (its number taken from the store's counter)."""
        return self.seal(key, value, int(self.inner.add(self._counter_name(key), 1)))

    # ---- the c10d Store interface ------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self.inner.set(self.name(key), self._sealed(key, value))

    def get(self, key: str) -> bytes:
        return self.open(key, self.inner.get(self.name(key)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        raws = self.inner.multi_get([self.name(k) for k in keys])
        return [self.open(k, raw) for k, raw in zip(keys, raws)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.inner.multi_set([self.name(k) for k in keys], [self._sealed(k, v) for k, v in zip(keys, values)])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """``expected`` must be empty (set ``desired`` if ``key`` is missing) or equal to ``desired``
        (a probe: the value if set, else ``expected``); both are compared unsealed on the server."""
        exp, want = _bytes(expected), _bytes(desired)
        if exp and exp != want:
            raise NotImplementedError("SealedStore.compare_set: a sealed value cannot be compared on the server")
        raw = self.inner.compare_set(self.name(key), exp, want if exp else self._sealed(key, want))
        return raw if exp and raw == exp else self.open(key, raw)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self.name(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check([self.name(k) for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self.name(k) for k in keys]
        if timeout is None:
            self.inner.wait(names)
        else:
            self.inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        """Delete ``key`` and its write counter (weightsync never writes a deleted key again)."""
        self.seen.pop(key, None)
        self.inner.delete_key(self._counter_name(key))
        return self.inner.delete_key(self.name(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def _refuse_other_listeners(port: int) -> None:
    """``EADDRINUSE`` when any socket of this host listens on ``port``, on any address or family: a
    wildcard bind (address reuse on, so a port in TIME_WAIT passes) conflicts with every listener."""
    for family, wildcard in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host: the IPv4 probe decides
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind((wildcard, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise OSError(errno.EADDRINUSE, f"port {port} is in use by another listener on this host "
                                                    "(one store host per port, whatever its address)") from None
                continue  # (e.g. no IPv6 address: the other family decides)
            return


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (port 0: a free port). TCPStore's own server binds
    every interface (``[::]``, dual-stack) whatever its host name says; this one is handed to it. A
    fixed port another socket of this host listens on, on any address, is refused (``EADDRINUSE``)."""
    family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    if port:
        _refuse_other_listeners(port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT, never a live listener
        sock.bind(address)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


def _host_store(host: str, port: int, timeout: timedelta) -> Any:
    """The TCPStore server on a socket listening on ``host:port`` only. It is handed a duplicate of the
    socket's descriptor; if it fails, that duplicate is closed only while it is still this socket (the
    store may have closed it already, and the number may then name another file)."""
    with listen_socket(host, port) as sock:
        fd = os.dup(sock.fileno())
        try:
            return dist.TCPStore(host, sock.getsockname()[1], None, is_master=True, timeout=timeout,
                                 wait_for_workers=False, master_listen_fd=fd, use_libuv=True)
        except BaseException:
            try:
                ours = os.fstat(fd).st_ino == os.fstat(sock.fileno()).st_ino
            except OSError:  # closed by the store
                ours = False
            if ours:
                os.close(fd)
            raise


def loopback_store(port: int, *, is_master: bool, timeout: timedelta) -> Any:
    """A plain TCPStore at ``127.0.0.1:port``, hosted on a socket listening on loopback only, or a client of
    it: for ``dist.init_process_group(store=...)`` on one machine (``init_method="tcp://127.0.0.1:..."``
    makes torch host its store on every interface)."""
    if is_master:
        return _host_store("127.0.0.1", port, timeout)
    return dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timeout, use_libuv=True)


def open_store(host: str, port: int, timeout_s: float, *, is_master: bool, secret: str | bytes | None,
               group: str = "", hosted: bool = False) -> Any:
    """The group's store at ``host:port``: its host (``is_master``, listening on ``host`` only) or a
    client; sealed when a secret is set (``store_secret(secret)``), with a new group id per hosted
    group (its keys: :func:`group_keys`). A client checks that its secret setting matches the host's
    (``DataPlaneError`` saying what to set) and, given ``group`` (hex, from a channel it trusts: a
    worker's init info), that the store's group is that one (else ``ForgedValueError``). ``hosted``: the
    host listened before this party was asked to connect, so a refused connection means the store is gone
    (its trainer's init failed, timed out or was shut down): :class:`StoreClosed` at once, where torch's
    client would retry for ``timeout_s``."""
    key = store_secret(secret)
    timeout = timedelta(seconds=timeout_s)
    if is_master:
        raw = _host_store(host, port, timeout)
        if key is None:
            raw.set(_MARKER, "open")
            return raw
        group = os.urandom(16)
        store = SealedStore(raw, key, group)
        raw.set(_GROUP, group.hex())
        raw.set(_CHECK, store._sealed(_CHECK, "ok"))  # plain name: a party with another secret fails to open it
        raw.set(_MARKER, "sealed")
        return store
    if hosted:
        _check_listening(host, port, timeout_s)
    return _client_store(host, port, timeout, key, group)


def _check_listening(host: str, port: int, timeout_s: float) -> None:
    """``StoreClosed`` when nothing listens at ``host:port`` (one TCP connect, closed at once; the host's
    store takes a client that leaves without a request). Any other failure is left to torch's client."""
    try:
        socket.create_connection((host, port), timeout=min(timeout_s, 5.0)).close()
    except ConnectionRefusedError:
        raise StoreClosed(f"the sync group's store at {host}:{port} refused the connection: nothing listens "
                          "there (its trainer's init failed or timed out, or the trainer shut it down)") from None
    except OSError:
        pass


def _closed(where: str, error: BaseException) -> StoreClosed:
    return StoreClosed(f"{where} closed the connection ({str(error).splitlines()[0][:200]})")


def _client_store(host: str, port: int, timeout: timedelta, key: bytes | None, expected: str) -> Any:
    raw = dist.TCPStore(host, port, None, is_master=False, timeout=timeout, use_libuv=True)
    where = f"the sync group's store at {host}:{port}"
    try:
        raw.wait([_MARKER], timeout)
        mark = raw.get(_MARKER)
    except dist.DistNetworkError as e:  # connected, then the store's host closed the connection
        raise _closed(where, e) from None
    except Exception as e:  # noqa: BLE001 - not a weightsync store, or it timed out
        raise DataPlaneError(f"{where} did not say whether it is sealed ({str(e).splitlines()[0][:200]})") from None
    if mark == b"open" and key is not None:
        raise DataPlaneError(f"{where} has no shared secret but this party has one ({SECRET_ENV}): "
                             "set the same secret on every party, or none")
    if mark == b"sealed" and key is None:
        raise DataPlaneError(f"{where} is sealed with a shared secret: set {SECRET_ENV} on this party")
    if mark not in (b"open", b"sealed"):
        raise ForgedValueError(f"forged value rejected under store key {_MARKER!r}: {mark[:40]!r}")
    if key is None:
        return raw
    try:
        group = bytes.fromhex(raw.get(_GROUP).decode())
    except ValueError:
        raise ForgedValueError(f"forged value rejected under store key {_GROUP!r}: not a group id") from None
    except dist.DistNetworkError as e:
        raise _closed(where, e) from None
    except Exception as e:  # noqa: BLE001 - deleted
        raise DataPlaneError(f"{where} has no group id under {_GROUP!r} ({str(e).splitlines()[0][:200]})") from None
    if len(group) != 16:
        raise ForgedValueError(f"forged value rejected under store key {_GROUP!r}: {len(group)} bytes, not 16")
    if expected and group.hex() != expected:
        raise ForgedValueError(f"forged value rejected under store key {_GROUP!r}: group {group.hex()}, but the "
                               f"init info names group {expected} (another group's store, or a replay)")
    store = SealedStore(raw, key, group)
    try:
        store.open(_CHECK, raw.get(_CHECK))
    except dist.DistNetworkError as e:
        raise _closed(where, e) from None
    except ForgedValueError:
        raise DataPlaneError(f"{where} is sealed with another secret than this party's ({SECRET_ENV})") from None
    return store
