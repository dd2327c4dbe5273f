"""The store sealed with a shared secret: a party without it can neither join a sync group nor read it.

TCPStore itself is unauthenticated: anyone who reaches its port can list, read and write every key.
With a secret set (``WEIGHTSYNC_STORE_SECRET``, or ``secret=`` to :meth:`Communicator.connect`),
every party talks to the store through :class:`SealedStore`:

- every key name is ``HMAC-SHA256(secret, name)`` (hex): ``list_keys`` and a raw client see only
  opaque names, and cannot derive the name of a key they have not seen set;
- every value is encrypted with a keystream of HMAC-SHA256 blocks under a fresh random nonce and
  authenticated (encrypt-then-MAC, the MAC covering the key name, so a value cannot be moved to
  another key). A value that fails authentication raises :class:`ForgedValueError` naming the key;
  a value set by a client without the secret under a plain name is never read at all.

Standard library only (``hmac``, ``hashlib``, ``secrets``). The data plane's rendezvous (gloo's and
NCCL's, through ``PrefixStore``) goes through the same sealed store, so the peers' addresses and
NCCL's unique id are sealed too. Counters (``add``) cannot be encrypted: they live under sealed
names with plain integer values (weightsync sets none; torch's rendezvous may).

What it does not do: a client without the secret can still delete or overwrite keys it has seen
(a denial of service: the sync then fails with ``ForgedValueError`` or times out, it never applies
forged data), and a value may be replayed under the same key name from an earlier group that used
the same secret. See docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .errors import DataPlaneError

__all__ = ["SECRET_ENV", "ForgedValueError", "SealedStore", "listen_socket", "open_store", "store_secret"]

SECRET_ENV = "WEIGHTSYNC_STORE_SECRET"
"""The environment variable every party reads the shared secret from (unset or empty: no secret)."""
_MAGIC = b"WS1"
_NONCE = 16
_TAG = 32
_BLOCK = hashlib.sha256().digest_size
_MARKER = "weightsync/store"
"""Set by the host, unsealed: ``open`` or ``sealed``, so that a party whose secret setting differs
from the host's gets a clear error at connect instead of waiting out its timeout."""
_CHECK = "weightsync/check"
"""A sealed value the host sets under this plain name: a client whose secret is not the group's fails
to open it."""


class ForgedValueError(DataPlaneError):
    """A store value failed authentication: set by a party without the group's secret, or corrupted."""


def store_secret(secret: str | bytes | None = None) -> bytes | None:
    """The shared secret to use: ``secret`` if given, else ``$WEIGHTSYNC_STORE_SECRET``; None when
    neither is set (an empty value counts as unset)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV, "")
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise ValueError(f"the store secret must be str or bytes, got {type(secret).__name__}")
    return secret or None


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class SealedStore(dist.Store):
    """A c10d ``Store`` over ``inner`` whose key names and values are sealed with ``secret``.

    Usable wherever torch takes a store (``PrefixStore``, ``ProcessGroupGloo``/``NCCL``).
    ``compare_set`` supports only what weightsync uses: an expected value that is empty ("set if
    missing") or a never-published sentinel ("read if set"), passed through unsealed."""

    def __init__(self, inner: Any, secret: bytes) -> None:
        super().__init__()
        self.inner = inner
        self._name_key = _mac(secret, b"weightsync/name")
        self._enc_key = _mac(secret, b"weightsync/encrypt")
        self._mac_key = _mac(secret, b"weightsync/authenticate")

    @property
    def host(self) -> str:
        return self.inner.host

    @property
    def port(self) -> int:
        return int(self.inner.port)

    def name(self, key: str) -> str:
        """The key's name on the wire: ``HMAC(secret, key)``, hex."""
        return "ws/" + hmac.new(self._name_key, key.encode(), hashlib.sha256).hexdigest()

    def _keystream(self, nonce: bytes, n: int) -> bytes:
        blocks = (n + _BLOCK - 1) // _BLOCK
        return b"".join(_mac(self._enc_key, nonce, i.to_bytes(8, "big")) for i in range(blocks))[:n]

    @staticmethod
    def _xor(data: bytes, stream: bytes) -> bytes:
        return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")

    def seal(self, key: str, value: bytes | str) -> bytes:
        """``value`` encrypted and authenticated for ``key``."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        nonce = os.urandom(_NONCE)
        cipher = self._xor(data, self._keystream(nonce, len(data)))
        return _MAGIC + nonce + _mac(self._mac_key, self.name(key).encode(), nonce, cipher) + cipher

    def open(self, key: str, blob: bytes) -> bytes:
        """``blob``'s plaintext; ``ForgedValueError`` naming ``key`` when it fails authentication."""
        blob = bytes(blob)
        head = len(_MAGIC) + _NONCE + _TAG
        if len(blob) < head or not blob.startswith(_MAGIC):
            raise ForgedValueError(f"forged value rejected under store key {key!r}: not sealed with this "
                                   f"group's secret ({len(blob)} bytes)")
        nonce, tag, cipher = blob[3:3 + _NONCE], blob[3 + _NONCE:head], blob[head:]
        if not hmac.compare_digest(tag, _mac(self._mac_key, self.name(key).encode(), nonce, cipher)):
            raise ForgedValueError(f"forged value rejected under store key {key!r}: its authentication "
                                   "tag does not match this group's secret")
        return self._xor(cipher, self._keystream(nonce, len(cipher)))

    # ---- the c10d Store interface ------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self.inner.set(self.name(key), self.seal(key, value))

    def get(self, key: str) -> bytes:
        return self.open(key, self.inner.get(self.name(key)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        raws = self.inner.multi_get([self.name(k) for k in keys])
        return [self.open(k, raw) for k, raw in zip(keys, raws)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.inner.multi_set([self.name(k) for k in keys], [self.seal(k, v) for k, v in zip(keys, values)])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """``expected`` must be empty (set ``desired`` if ``key`` is missing) or equal to ``desired``
        (a probe: the value if set, else ``expected``); both are compared unsealed on the server."""
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        want = desired.encode() if isinstance(desired, str) else bytes(desired)
        if exp and exp != want:
            raise NotImplementedError("SealedStore.compare_set: a sealed value cannot be compared on the server")
        raw = self.inner.compare_set(self.name(key), exp, want if exp else self.seal(key, want))
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
        return self.inner.delete_key(self.name(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (port 0: a free port). TCPStore's own server binds
    every interface (``[::]``, dual-stack) whatever its host name says; this one is handed to it."""
    family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT, never a live listener
        sock.bind(address)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


def open_store(host: str, port: int, timeout_s: float, *, is_master: bool, secret: str | bytes | None) -> Any:
    """The group's store at ``host:port``: its host (``is_master``, listening on ``host`` only) or a
    client; sealed when a secret is set (``store_secret(secret)``). A client checks that its secret
    setting matches the host's (``DataPlaneError`` saying what to set)."""
    key = store_secret(secret)
    timeout = timedelta(seconds=timeout_s)
    if is_master:
        sock = listen_socket(host, port)
        bound = sock.getsockname()[1]
        fd = sock.detach()
        try:
            raw = dist.TCPStore(host, bound, None, is_master=True, timeout=timeout, wait_for_workers=False,
                                master_listen_fd=fd, use_libuv=True)
        except BaseException:
            os.close(fd)
            raise
        store = raw if key is None else SealedStore(raw, key)
        if key is not None:  # under its plain name: a party with another secret finds it, and fails to open it
            raw.set(_CHECK, store.seal(_CHECK, "ok"))
        raw.set(_MARKER, "open" if key is None else "sealed")
        return store
    raw = dist.TCPStore(host, port, None, is_master=False, timeout=timeout, use_libuv=True)
    where = f"the sync group's store at {host}:{port}"
    try:
        raw.wait([_MARKER], timeout)
        mark = raw.get(_MARKER)
    except Exception as e:  # noqa: BLE001 - not a weightsync store, or it went away
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
    store = SealedStore(raw, key)
    try:
        store.open(_CHECK, raw.get(_CHECK))
    except ForgedValueError:
        raise DataPlaneError(f"{where} is sealed with another secret than this party's ({SECRET_ENV})") from None
    return store
