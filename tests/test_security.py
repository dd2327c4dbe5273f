"""Hardening (issue 34): the store listens only where it is told and, with a shared secret, a party
without it reads nothing and forges nothing; a failed group's port can be hosted again."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers import listeners, until
from weightsync.comm import Communicator
from weightsync.errors import DataPlaneError
from weightsync.sealed import SECRET_ENV, ForgedValueError
from weightsync.testing.actors import RemoteError
from weightsync.testing.faults import JsonRoundTripClient

pytestmark = [pytest.mark.timeout(600)]
TIMEOUT_S = 20.0
SECRET = "4f1c-shared-secret-of-the-test-" + "0123456789abcdef" * 2  # >= 32 bytes
PLAIN = "plan-digest-0123456789abcdef"


@pytest.mark.parametrize("secret", [None, SECRET])
def test_the_store_listens_on_the_named_address_only(secret):
    host = Communicator.connect("127.0.0.1", 0, name="host", timeout_s=TIMEOUT_S, host_store=True, secret=secret)
    try:
        assert listeners(host.port) == ["0100007F"]  # 127.0.0.1 only: not 0.0.0.0, not [::]
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
        Communicator.connect("127.0.0.1", sealed_host.port, name="worker 0", timeout_s=TIMEOUT_S, secret="guess" * 8)
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
        comm.data.wait_all([comm.data.broadcast(t, 0)], "broadcast")
        out[rank] = t
    threads = [threading.Thread(target=join, args=(c, r)) for r, c in enumerate((sealed_host, client))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert torch.equal(out[1], torch.arange(4.0))
    keys = _raw_client(sealed_host.port).list_keys()
    plain = ("weightsync/store", "weightsync/check", "weightsync/group")
    assert keys and all(k.startswith("ws/") or k in plain for k in keys), keys
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


def _set_secret(actors, value: str | None) -> None:
    code = (f"import os; os.environ[{SECRET_ENV!r}] = {value!r}" if value else
            f"import os; os.environ.pop({SECRET_ENV!r}, None)")
    for a in actors:
        a.call("builtins:exec", code, {})


@pytest.mark.vllm
def test_a_sync_with_the_secret_works_end_to_end_and_a_party_without_it_is_refused(cluster):
    from helpers import init_info, mismatches
    from weightsync.testing.cluster import Layout

    layout = Layout(trainers=2, tp=2, backend="weightsync_nccl")  # its data plane: gloo, rendezvous on the store
    cluster.setup(layout)
    parties = cluster.active_trainers + cluster.active_receivers
    info = init_info("weightsync_nccl", layout, buffer_bytes=1 << 16, timeout_s=TIMEOUT_S)
    try:
        _set_secret(parties, SECRET)
        cluster.make_engines(info)
        cluster.train_step(3)
        cluster.sync(weight_version="sealed", verify=True)
        assert mismatches(cluster) == {}
        assert cluster.client().weight_versions() == ["sealed"] * layout.num_workers
        _set_secret(cluster.active_trainers, None)  # the workers still have it: each refuses the open store
        fresh = init_info("weightsync_nccl", layout, buffer_bytes=1 << 16, timeout_s=TIMEOUT_S)  # a new port:
        futs = [a.submit("weightsync.testing.trainer:make_engine", fresh, cluster.client(), source="full")  # not
                for a in cluster.active_trainers]  # the old group's store, which rank 0 may still host
        for f in futs:
            with pytest.raises(RemoteError, match=r"has no shared secret but this party has one "
                                                  rf"\({SECRET_ENV}\): set the same secret on every party"):
                f.result(timeout=4 * TIMEOUT_S)
    finally:
        _set_secret(parties, None)


# --- delta messages are validated before any patch (item 2) ---------------------------------------
def _valid_message(g: torch.Generator, bitmap: bool):
    """Two parameters, each patched through a non-contiguous region view; a valid sparse message."""
    from weightsync.reshard.delta import _layout, diff, encode

    params = [torch.randint(-50, 50, (40, 50), generator=g, dtype=torch.int16).view(torch.bfloat16),
              torch.randint(-50, 50, (12, 30), generator=g, dtype=torch.int16).view(torch.bfloat16)]
    targets = [params[0][1:39, 2:49], params[1][1:11, 1:29:2]]  # 1786 and 140 values, neither contiguous
    news = [t.clone() for t in targets]
    for new in news:
        flat = new.view(-1)
        k = (60 if bitmap else 2) + int(torch.randint(0, 60 if bitmap else 12, (1,), generator=g))
        where = torch.randperm(flat.numel(), generator=g)[:k]
        flat[where] = (flat[where].view(torch.int16) + 1).view(torch.bfloat16)
    parts = [diff(n, t) for n, t in zip(news, targets)]
    numels = [t.numel() for t in targets]
    n = sum(v.numel() for _, v in parts)
    assert _layout(numels, n, 2)[0] == bitmap
    return params, targets, encode(parts, 2), numels, n


def _malform(buf: torch.Tensor, numels: list[int], n: int, bitmap: bool, g: torch.Generator):
    """A copy of the message broken in one way that must be refused; returns (buf, n)."""
    from weightsync.reshard.delta import _layout

    buf, r = buf.clone(), int(torch.randint(0, 1000, (1,), generator=g))
    counts = buf[:8].view(torch.int32)
    i = r % 2
    at = 8 + (0 if i == 0 else (4 * int(counts[0]) if not bitmap else (numels[0] + 7) // 8))
    kinds = ["count_negative", "count_too_big", "count_off", "n_off", "n_negative", "truncated"]
    kinds += ["padding_bit", "bit_flip"] if bitmap else ["duplicate", "too_big", "negative", "decreasing"]
    kind = kinds[int(torch.randint(0, len(kinds), (1,), generator=g))]
    pos = buf[at : at + 4 * int(counts[i])].view(torch.int32) if not bitmap else None
    if kind == "count_negative":
        counts[i] = -1 - r
    elif kind == "count_too_big":
        counts[i] = numels[i] + 1 + r
    elif kind == "count_off":
        counts[i] += 1
    elif kind == "n_off":
        n += 1 + r % (sum(numels) - n)
    elif kind == "n_negative":
        n = -1 - r
    elif kind == "truncated":
        buf = buf[: _layout(numels, n, 2)[2] - 1 - r % 8]
    elif kind == "padding_bit":
        buf[8 + (numels[0] + 7) // 8 - 1] |= 0x80  # 1786 values: the last byte's bit 7 is past the end
    elif kind == "bit_flip":
        j = r % numels[i]
        buf[at + j // 8] ^= 1 << (j % 8)
    elif kind == "duplicate":
        pos[1] = pos[0]
    elif kind == "too_big":
        pos[-1] = numels[i] + r
    elif kind == "negative":
        pos[0] = -1 - r
    else:
        pos[0], pos[1] = pos[1].clone(), pos[0].clone()
    return buf, n


def test_a_thousand_malformed_delta_messages_write_nothing_and_name_the_parameter():
    from weightsync.reshard.delta import decode, patch

    g = torch.Generator().manual_seed(34)
    names = ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    for trial in range(1000):
        bitmap = trial % 2 == 0
        params, targets, buf, numels, n = _valid_message(g, bitmap)
        bad, bad_n = _malform(buf, numels, n, bitmap, g)
        before = [p.clone() for p in params]
        with pytest.raises(ValueError, match=r"parameter '(model\.layers\.0\.mlp\.down_proj|model\.norm)\.weight'"):
            for target, (positions, values) in zip(targets, decode(bad, numels, bad_n, 2, names)):
                patch(target, positions, values)
        assert all(torch.equal(b.view(torch.int16), p.view(torch.int16)) for b, p in zip(before, params)), trial
    params, targets, buf, numels, n = _valid_message(g, bitmap=False)  # and a valid one still patches
    for target, (positions, values) in zip(targets, decode(buf, numels, n, 2, names)):
        patch(target, positions, values)


# --- the CPU ipc buffer never outlives its process (item 7) --------------------------------------
def _own_files(pid: int) -> list[str]:
    from weightsync.transports.ipc_handles import SHM_DIR, SHM_PREFIX

    return [f for f in os.listdir(SHM_DIR) if f.startswith(f"{SHM_PREFIX}{pid}-")]


def _buffer_in(conn, kill: bool) -> None:
    from weightsync.transports.ipc_handles import ExportedBuffer

    buf = ExportedBuffer(1 << 20, torch.device("cpu"), tag="test-")
    buf.tensor.fill_(1)
    conn.send(buf.path)  # a pipe: sent before the kill (a queue's feeder thread may not be)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    del buf  # collected without unlink or close: the finalizer removes the file
    conn.send(None)


@pytest.mark.parametrize("kill", [False, True], ids=["collected", "sigkilled"])
def test_a_cpu_buffer_file_is_removed_when_its_owner_drops_it_or_dies(kill):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_buffer_in, args=(child, kill))
    p.start()
    child.close()
    assert parent.poll(120)
    path = parent.recv()
    p.join(120)
    assert p.exitcode == (-signal.SIGKILL if kill else 0)
    until(lambda: not os.path.exists(path), f"{path} outlived its process", TIMEOUT_S)


class KillingClient(JsonRoundTripClient):
    """SIGKILLs the trainer process it runs in at its first ``update_weights`` of a sync: the ipc
    buffer exists, its handle went out, nothing unlinked it yet."""

    def update_weights(self, update_info):
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.vllm
def test_sigkilled_ipc_trainers_mid_sync_leave_nothing_in_dev_shm(cluster):
    from helpers import init_info
    from weightsync.testing.cluster import Layout

    layout = Layout(trainers=2, tp=2, backend="weightsync_ipc")
    cluster.setup(layout)
    try:
        pids = [a.call("os:getpid") for a in cluster.active_trainers]
        cluster.make_engines(init_info("weightsync_ipc", layout, buffer_bytes=64 << 10, timeout_s=TIMEOUT_S),
                             client=KillingClient(cluster.client()))
        futs = [a.submit("weightsync.testing.trainer:send_weights", "killed") for a in cluster.active_trainers]
        with pytest.raises((RemoteError, OSError, EOFError)):
            futs[0].result(timeout=4 * TIMEOUT_S)  # rank 0 killed itself mid-sync
        assert _own_files(pids[1]), "rank 1's buffer exists mid-sync"
        cluster.active_trainers[1].kill()
        for pid in pids:
            until(lambda pid=pid: not _own_files(pid), f"trainer {pid}'s ipc buffer outlived it: {_own_files(pid)}",
                  TIMEOUT_S)
    finally:
        cluster.replace_dead()


# --- re-init after a failed sync: the error says what to call (item 8) ---------------------------
def test_poisoned_errors_name_the_call_that_recovers():
    from weightsync.errors import PoisonedError
    from weightsync.registry import transport

    spec = transport("weightsync_nccl")
    trainer = object.__new__(spec.trainer_engine)  # the state send_weights checks first
    trainer.failed = "worker 1: ValueError: a wrong shape"
    with pytest.raises(PoisonedError, match=r"call NCCLTrainerEngine\.trainer_init\(init_info, client=\.\.\., "
                                            r"source=\.\.\.\) again on every trainer rank \(the same master_port "
                                            r"works\)"):
        trainer.send_weights()
    worker = object.__new__(spec.worker_engine)
    worker.poisoned = "ValueError: a wrong shape"
    with pytest.raises(PoisonedError, match=r"re-initialize from the trainer: TrainerEngine\.trainer_init on every "
                                            r"trainer rank, which calls init_weight_transfer_engine on every engine"):
        worker.start_weight_update()


# ---- pausing by default (issue 34 item 5) ---------------------------------------------------------
@pytest.mark.vllm
def test_an_unpaused_sync_is_refused_on_every_rank_before_anything_moves(cluster):
    """More in tests/test_pausing.py (partly applied weights stay paused; the middleware's /resume)."""
    from helpers import init_info, mismatches
    from test_failures import on_every_trainer
    from weightsync.testing.cluster import Layout

    layout = Layout(trainers=2, tp=2, replicas=2, backend="weightsync_nccl")
    cluster.setup(layout)
    client, info = cluster.client(), lambda **kw: init_info("weightsync_nccl", layout, timeout_s=TIMEOUT_S, **kw)
    cluster.make_engines(info())
    cluster.sync(weight_version="good")  # inside clients.paused: resumed after it
    assert list(client.generation_paused().values()) == [False, False]
    before = cluster.on_receivers("checksum")
    cluster.train_step(5)
    client.pause_generation()
    for a in cluster.active_receivers[2:]:  # engine 1 (replica 1) serves again
        a.call("weightsync.testing.client:_set", "weightsync_paused", False)
    t0 = time.perf_counter()
    errors = on_every_trainer(cluster, "weightsync.testing.trainer:send_weights", "unpaused", pause=False)
    elapsed = time.perf_counter() - t0
    r2, r3 = (a.name for a in cluster.active_receivers[2:])
    for e in errors:  # every rank: the same refusal, naming the engine that serves
        assert (f"Refused: weight sync refused: engine 1 ({r2}, {r3}): generation is not paused (1 of 2 engine(s)); "
                "call client.pause_generation() before send_weights") in e, e
    assert elapsed < TIMEOUT_S, f"refused after {elapsed:.1f} s"
    assert cluster.on_receivers("checksum") == before  # nothing moved, nothing poisoned
    assert cluster.client().weight_versions() == ["good"] * layout.num_workers
    assert [a.call("weightsync.testing.probes:engine_poisoned") for a in cluster.active_receivers] == [None] * 4
    client.resume_generation()  # none paused: both named
    errors = on_every_trainer(cluster, "weightsync.testing.trainer:send_weights", "unpaused", pause=False)
    assert all("engine 0 (" in e and "engine 1 (" in e and "(2 of 2 engine(s))" in e for e in errors), errors
    cluster.make_engines(info(require_paused=False))  # explicitly allowed: syncs while serving
    cluster.on_trainers("send_weights", "unpaused-allowed", pause=False)
    assert mismatches(cluster) == {} and list(client.generation_paused().values()) == [False, False]


# ---- issue 56 item 1: per-group keys, write counters, cryptography's AES-GCM -------------------------------
def _hosted(port: int = 0) -> Communicator:
    return Communicator.connect("127.0.0.1", port, name="trainer rank 0", timeout_s=TIMEOUT_S, host_store=True,
                                secret=SECRET)


def _client(host: Communicator, **kwargs) -> Communicator:
    return Communicator.connect("127.0.0.1", host.port, name="trainer rank 1", timeout_s=TIMEOUT_S, secret=SECRET,
                                **kwargs)


def _copy(key: str, src: Communicator, dst: Communicator) -> None:
    """What an attacker on the network does: ``key``'s sealed bytes from ``src``'s store into ``dst``'s, under
    the name ``dst``'s parties read it by."""
    value = _raw_client(src.port).get(src.store.name(key))
    _raw_client(dst.port).set(dst.store.name(key), value)


def test_a_value_of_another_live_group_sharing_the_secret_is_refused_naming_the_key():
    a, b = _hosted(), _hosted()
    try:
        a.publish("sync1/verdict", "ok")
        reader = _client(b)
        _copy("sync1/verdict", a, b)  # B never published a verdict
        with pytest.raises(ForgedValueError, match=r"rejected under store key 'sync1/verdict'"):
            reader.read("sync1/verdict")
    finally:
        a.shutdown()
        b.shutdown()


def test_a_value_from_before_a_re_init_on_the_same_port_is_refused_naming_the_key():
    a = _hosted()
    port = a.port
    a.publish("init/done", "ok")
    recorded = {"name": a.store.name("init/done"), "value": _raw_client(port).get(a.store.name("init/done"))}
    a.shutdown()
    del a
    hosted: list[Communicator] = []
    until(lambda: hosted.append(h) is None if (h := _try_host(port)) else False, "the port free again", TIMEOUT_S)
    b = hosted[0]
    try:
        reader = _client(b)
        _raw_client(port).set(b.store.name("init/done"), recorded["value"])
        with pytest.raises(ForgedValueError, match=r"rejected under store key 'init/done'"):
            reader.read("init/done")
    finally:
        b.shutdown()


def _try_host(port: int) -> Communicator | None:
    try:
        return _hosted(port)
    except OSError:
        return None


def test_a_client_given_the_group_id_refuses_a_store_that_names_another():
    a, b = _hosted(), _hosted()
    try:
        assert len(a.group) == 32 and a.group != b.group  # a random group id per hosted group
        assert _client(a, group=a.group).group == a.group
        with pytest.raises(ForgedValueError, match=r"rejected under store key 'weightsync/group'"):
            _client(b, group=a.group)
    finally:
        a.shutdown()
        b.shutdown()


def test_a_rewritten_keys_old_value_is_refused_naming_the_key(sealed_host):
    reader = _client(sealed_host)
    sealed_host.publish("sync3/held/0", 3)
    old = _raw_client(sealed_host.port).get(sealed_host.store.name("sync3/held/0"))
    assert reader.read("sync3/held/0") == 3
    sealed_host.publish("sync3/held/0", None)  # the worker dropped it
    assert reader.peek("sync3/held/0") is None
    _raw_client(sealed_host.port).set(sealed_host.store.name("sync3/held/0"), old)  # 3 -> None -> 3
    with pytest.raises(ForgedValueError, match=r"replayed value rejected under store key 'sync3/held/0': write 1 "
                                               r"of the key, but this party already read write 2"):
        reader.peek("sync3/held/0")


def test_a_value_cannot_move_to_another_key(sealed_host):
    reader = _client(sealed_host)
    sealed_host.publish("sync1/started", "ok")
    raw = _raw_client(sealed_host.port)
    raw.set(sealed_host.store.name("sync1/verdict"), raw.get(sealed_host.store.name("sync1/started")))
    with pytest.raises(ForgedValueError, match=r"rejected under store key 'sync1/verdict'"):
        reader.read("sync1/verdict")


@pytest.mark.parametrize("secret", ["short", "x" * 31])
def test_a_secret_under_32_bytes_is_refused_saying_how_to_make_one(secret):
    with pytest.raises(ValueError, match=r"must be at least 32 bytes, got \d+: make one with python -c "
                                         r"\"import secrets; print\(secrets.token_hex\(32\)\)\""):
        Communicator.connect("127.0.0.1", 0, name="host", timeout_s=TIMEOUT_S, host_store=True, secret=secret)


def test_sealing_uses_aes_gcm_not_a_hand_written_cipher():
    from pathlib import Path

    from weightsync import sealed

    source = Path(sealed.__file__).read_text()
    assert "AESGCM" in source and "HKDF" in source and "_keystream" not in source and "_xor" not in source


# ---- issue 56 item 5: one host per port, a deep value named, not "unreachable" ------------------------------
def test_a_second_store_host_on_a_live_port_is_refused_whatever_its_address(sealed_host):
    with pytest.raises(OSError) as e:
        Communicator.connect("127.0.0.2", sealed_host.port, name="other", timeout_s=TIMEOUT_S, host_store=True)
    assert e.value.errno == errno.EADDRINUSE and f"master_port {sealed_host.port}" in str(e.value)


def test_a_value_nested_200000_deep_is_named_not_reported_as_an_unreachable_store():
    host = Communicator.connect("127.0.0.1", 0, name="trainer rank 0", timeout_s=TIMEOUT_S, host_store=True, secret="")
    try:
        reader = Communicator.connect("127.0.0.1", host.port, name="worker 0", timeout_s=TIMEOUT_S, secret="")
        _raw_client(host.port).set("sync1/started", "[" * 200_000 + "]" * 200_000)
        with pytest.raises(DataPlaneError, match=r"the value under store key 'sync1/started' is nested too deep") as e:
            reader.read("sync1/started")
        assert "unreachable" not in str(e.value)
        assert reader.peer_error() is None
    finally:
        host.shutdown()
