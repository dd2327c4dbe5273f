"""Hardening (issue 34): the store listens only where it is told and, with a shared secret, a party
without it reads nothing and forges nothing; a failed group's port can be hosted again."""

from __future__ import annotations

import errno
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from weightsync.comm import Communicator
from weightsync.errors import DataPlaneError
from weightsync.sealed import SECRET_ENV, ForgedValueError

pytestmark = [pytest.mark.timeout(600)]
TIMEOUT_S = 20.0
SECRET = "4f1c-shared-secret-of-the-test"
PLAIN = "plan-digest-0123456789abcdef"


def _listeners(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


@pytest.mark.parametrize("secret", [None, SECRET])
def test_the_store_listens_on_the_named_address_only(secret):
    host = Communicator.connect("127.0.0.1", 0, name="host", timeout_s=TIMEOUT_S, host_store=True, secret=secret)
    try:
        assert _listeners(host.port) == ["0100007F"]  # 127.0.0.1 only: not 0.0.0.0, not [::]
        client = Communicator.connect("127.0.0.1", host.port, name="client", timeout_s=TIMEOUT_S, secret=secret)
        host.publish("k", [1, 2])
        assert client.read("k") == [1, 2]
    finally:
        host.shutdown()


@pytest.fixture
def sealed_host():
    host = Communicator.connect("127.0.0.1", 0, name="trainer rank 0", timeout_s=TIMEOUT_S, host_store=True,
                                secret=SECRET)
    yield host
    host.shutdown()


def _raw_client(port: int):
    return dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))


def test_a_raw_client_without_the_secret_reads_nothing_useful(sealed_host):
    sealed_host.publish("model/metas/0", {"digest": PLAIN})
    sealed_host.record("a real failure")
    raw = _raw_client(sealed_host.port)
    keys = raw.list_keys()
    assert len(keys) >= 3
    for key in keys:
        value = raw.get(key)
        assert not any(w in key for w in ("model", "error", "metas")), key
        assert PLAIN.encode() not in value and b"real failure" not in value and SECRET.encode() not in value, key
    assert not raw.check(["model/metas/0"]) and not raw.check(["error"])


def test_no_party_joins_without_the_same_secret(sealed_host, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(DataPlaneError, match=rf"is sealed with a shared secret: set {SECRET_ENV} on this party"):
        Communicator.connect("127.0.0.1", sealed_host.port, name="worker 0", timeout_s=TIMEOUT_S)
    with pytest.raises(DataPlaneError, match=rf"is sealed with another secret than this party's \({SECRET_ENV}\)"):
        Communicator.connect("127.0.0.1", sealed_host.port, name="worker 0", timeout_s=TIMEOUT_S, secret="guess")
    monkeypatch.setenv(SECRET_ENV, SECRET)  # the environment variable is the default secret
    worker = Communicator.connect("127.0.0.1", sealed_host.port, name="worker 0", timeout_s=TIMEOUT_S)
    sealed_host.publish("x", 7)
    assert worker.read("x") == 7
    open_host = Communicator.connect("127.0.0.1", 0, name="host", timeout_s=TIMEOUT_S, host_store=True, secret="")
    try:
        with pytest.raises(DataPlaneError, match=r"has no shared secret but this party has one"):
            Communicator.connect("127.0.0.1", open_host.port, name="worker 0", timeout_s=TIMEOUT_S)
    finally:
        open_host.shutdown()


def test_a_forged_failure_is_not_raised_and_a_forged_value_is_rejected_naming_its_key(sealed_host):
    waiter = Communicator.connect("127.0.0.1", sealed_host.port, name="trainer rank 1", timeout_s=TIMEOUT_S,
                                  secret=SECRET)
    raw = _raw_client(sealed_host.port)
    got: list = []
    thread = threading.Thread(target=lambda: got.append(waiter.await_key("sync1/verdict")))
    thread.start()
    raw.set("error", "trainer rank 0: forged failure")  # what an unsealed party would report
    raw.set("sync1/verdict", "failed")  # and the mark that wakes a waiting party
    assert sealed_host.peer_error() is None  # (the waiter's own connection is busy in its wait)
    sealed_host.publish("sync1/verdict", "ok")
    thread.join(TIMEOUT_S)
    assert got == ["ok"] and waiter.peer_error() is None
    sealed_host.publish("sync1/started", "ok")
    name = waiter.store.name("sync1/started")
    assert name in raw.list_keys()
    raw.set(name, "ok")  # a raw client overwrites a sealed key it saw with a value it cannot seal
    with pytest.raises(ForgedValueError, match=r"forged value rejected under store key 'sync1/started'"):
        waiter.read("sync1/started")


def test_the_data_plane_rendezvous_goes_through_the_sealed_store(sealed_host):
    client = Communicator.connect("127.0.0.1", sealed_host.port, name="worker 0", timeout_s=TIMEOUT_S, secret=SECRET)
    out = [torch.zeros(4), torch.zeros(4)]

    def join(comm, rank):
        comm.join(rank, 2)
        t = torch.arange(4.0) if rank == 0 else out[rank]
        comm.broadcast(t, src=0)
        out[rank] = t
    threads = [threading.Thread(target=join, args=(c, r)) for r, c in enumerate((sealed_host, client))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert torch.equal(out[1], torch.arange(4.0))
    keys = _raw_client(sealed_host.port).list_keys()
    assert keys and all(k.startswith("ws/") or k in ("weightsync/store", "weightsync/check") for k in keys), keys
    client.shutdown()


def test_a_failed_group_releases_its_fixed_port_for_the_next_init():
    first = Communicator.connect("127.0.0.1", 0, name="trainer rank 0", timeout_s=TIMEOUT_S, host_store=True)
    port = first.port
    with pytest.raises(OSError, match=rf"master_port {port} on '127.0.0.1' is in use by a live sync group of this "
                                      r"process: shut its engine down first") as e:
        Communicator.connect("127.0.0.1", port, name="trainer rank 0", timeout_s=TIMEOUT_S, host_store=True)
    assert e.value.errno == errno.EADDRINUSE
    first.fail("ValueError: the source yielded a wrong shape")  # its engine is never shut down
    second = Communicator.connect("127.0.0.1", port, name="trainer rank 0", timeout_s=TIMEOUT_S, host_store=True)
    try:
        assert second.port == port and second.peer_error() is None
    finally:
        second.shutdown()
