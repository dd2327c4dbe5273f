"""The control contract (``weightsync.control``): no store key is spelled outside it; agreement
names the first differing entry on every rank; the data plane's members decide to join together;
the store does not grow with the number of syncs (per-sync keys deleted once acknowledged)."""

from __future__ import annotations

import ast
import re
import threading
import time
from pathlib import Path

import pytest

import weightsync
from helpers import init_info
from weightsync.comm import Communicator
from weightsync.control import JOIN_DECISION, Listing, SyncKeys, agree, join_key
from weightsync.errors import DataPlaneError
from weightsync.testing.actors import STATE, RemoteError, free_port
from weightsync.testing.cluster import Layout
from weightsync.testing.faults import BAD_NAME

SRC = Path(weightsync.__file__).parent
KEY_METHODS = {"publish", "read", "read_all", "peek", "await_key", "await_keys", "wait_for", "fail_keys", "delete"}
"""The Communicator's methods that take store keys first."""


def _spelled_keys(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls ``x.<key method>(key, ...)`` whose key (or an element of a key list) is a str literal or f-string."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in KEY_METHODS and node.args):
            continue
        arg = node.args[0]
        parts = arg.elts if isinstance(arg, (ast.List, ast.Tuple)) else [arg]
        if isinstance(arg, ast.ListComp):
            parts = [arg.elt]
        if any(isinstance(p, ast.JoinedStr) or (isinstance(p, ast.Constant) and isinstance(p.value, str))
               for p in parts):
            found.append((node.lineno, ast.unparse(node)[:120]))
    return found


def test_no_store_key_is_spelled_outside_the_control_module():
    offenders = [f"{path.relative_to(SRC)}:{line}: {call}" for path in sorted(SRC.rglob("*.py"))
                 if path.name != "control.py" for line, call in _spelled_keys(ast.parse(path.read_text()))]
    assert offenders == []


def test_the_key_scan_finds_a_spelled_key():
    tree = ast.parse('comm.publish(f"sync{n}/recv/{w}", 1)\nself.comm.read("init/done")\n'
                     'c.wait_for([f"x/{r}" for r in rs], 1)\nc.fail_keys([keys.started, "v"])\nc.read(keys.started)')
    assert [line for line, _ in _spelled_keys(tree)] == [1, 2, 3, 4]


def test_sync_keys_are_distinct_and_outcome_keys_leave_held_for_the_next_delta():
    keys = SyncKeys(7)
    outcome = keys.outcome_keys(ranks=2, workers=4, chunks=3)
    # per worker: recv, phases, drafter, finishing
    assert len(set(outcome)) == len(outcome) == 4 + 5 * 2 + 4 * 4 + 3 * 3
    assert all(k.startswith("sync7/") for k in outcome)
    assert keys.held(0) not in outcome and keys.recv(3) in outcome and keys.chunk(2, 1) in outcome
    assert SyncKeys(7).sizes(1) != SyncKeys(71).sizes(1) != SyncKeys(7).sums(1)


# --- agree() and join, over one process's store ----------------------------------------------
def _parties(n: int, timeout_s: float = 5.0) -> list[Communicator]:
    port = free_port()
    host = Communicator.connect("127.0.0.1", port, name="rank 0", timeout_s=timeout_s, host_store=True)
    return [host] + [Communicator.connect("127.0.0.1", port, name=f"rank {r}", timeout_s=timeout_s)
                     for r in range(1, n)]


def _on_every(parties, fn):
    """``fn(rank, comm)`` in a thread per party; each party's result or exception."""
    out: list = [None] * len(parties)

    def run(r):
        try:
            out[r] = fn(r, parties[r])
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(parties))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_agree_names_the_first_missing_entry_and_both_values_on_every_rank():
    listings = [[["a", 1], ["b", 2], ["c", 3]], [["a", 1], ["c", 3]], [["a", 1], ["b", 2], ["c", 3]]]

    def run(r, comm):
        items = listings[r]
        return agree(comm, lambda k: f"t/{k}", str(items), rank=r, ranks=3, what="metadata", who="trainer rank",
                     listing=Listing(lambda k: f"t/list/{k}", items, lambda x: x[0], lambda x: f"size {x[1]}"))
    errors = _on_every(_parties(3), run)
    assert all(type(e) is ValueError for e in errors), errors
    assert {str(e) for e in errors} == {"parameter 'b': trainer rank 1's metadata differs from trainer rank 0's at "
                                        "position 1: trainer rank 0 has size 2, trainer rank 1 has nothing"}


def test_agree_names_both_values_of_a_differing_entry_and_returns_an_agreed_value():
    listings = [[["a", 1], ["b", 2]], [["a", 1], ["b", 5]]]

    def run(r, comm):
        return agree(comm, lambda k: f"t/{k}", str(listings[r]), rank=r, ranks=2, what="metadata", who="trainer rank",
                     listing=Listing(lambda k: f"t/list/{k}", listings[r], lambda x: x[0], lambda x: f"size {x[1]}"))
    assert {str(e) for e in _on_every(_parties(2), run)} == {
        "parameter 'b': trainer rank 1's metadata differs from trainer rank 0's at position 1: trainer rank 0 has "
        "size 2, trainer rank 1 has size 5"}
    assert _on_every(_parties(2),
                     lambda r, c: agree(c, lambda k: f"d/{k}", "x", rank=r, ranks=2, what="d")) == ["x"] * 2


def test_join_decided_as_failed_wakes_a_member_that_saw_every_announcement():
    """The nccl init race (issue 35, item 4), in a forced order: a party failed; member 1 announced
    itself, saw the failure while member 0's announcement was missing and left; member 0 then saw
    every announcement. It used to build the group with member 1 and wait out ``timeout_s``."""
    timeout_s = 8.0
    host, member = _parties(2, timeout_s)
    host.record("trainer rank 1: ValueError: parameter 'x': dtype torch.complex64 is not supported")
    with pytest.raises(DataPlaneError, match="complex64"):
        member.join(1, 2)
    t0 = time.monotonic()
    with pytest.raises(DataPlaneError, match="complex64"):
        host.join(0, 2)
    assert time.monotonic() - t0 < timeout_s / 4


def test_join_decided_as_ok_builds_the_group_although_a_failure_came_after():
    host, member = _parties(2)
    host.publish(join_key(0), "rank 0")  # (announced before the failure: member 1 sees every announcement)
    member_done = threading.Event()

    def join_member():
        member.join(1, 2)
        member_done.set()
    t = threading.Thread(target=join_member)
    t.start()  # the member decides "ok", then blocks building the group with rank 0
    assert host.wait_for([JOIN_DECISION], 10.0)
    host.record("trainer rank 1: a failure after the decision")
    host.join(0, 2)  # builds the group with the member that decided for both
    t.join()
    assert member_done.is_set()
    for c in (host, member):
        c.shutdown()


# --- harness: trainer ranks whose metadata differ (M2N), the store's size over many syncs -------
M2N = Layout(trainers=2, tp=2, backend="weightsync_m2n")


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_m2n_trainer_ranks_with_different_metadata_raise_value_error_naming_the_missing_tensor(cluster):
    """Issue 35, item 3: rank 1's source lacks ``BAD_NAME``; both ranks named the tensor at the first
    differing position, with no values, and rank 0 raised ``DataPlaneError``."""
    cluster.setup(M2N)
    info = init_info("weightsync_m2n", M2N, timeout_s=10.0)
    futs = [a.submit("weightsync.testing.trainer:make_engine", info, cluster.client(), source="local",
                     fault="rank1_differs") for a in cluster.active_trainers]
    message = (rf"ValueError: parameter '{re.escape(BAD_NAME)}': trainer rank 1's metadata differs from trainer "
               r"rank 0's at position \d+: trainer rank 0 has float32 \(128, 64\) "
               r"\(shards \[\(64, 64\), \(64, 64\)\]\), "
               r"trainer rank 1 "
               r"has nothing")
    for f in futs:
        with pytest.raises(RemoteError) as e:
            f.result(timeout=30)
        assert re.search(message, str(e.value).split("\nTraceback")[0]), str(e.value)[:600]


def store_keys() -> int:
    """Inside trainer rank 0: the keys on the group's store (it hosts it)."""
    return int(STATE["engine"].comm.store.num_keys())


KEY_COUNT_CASES = {
    "m2n": (M2N, {}),
    "m2n delta": (Layout(trainers=2, tp=2, replicas=2, dtype="bfloat16", trainer_dtype="float32",
                         backend="weightsync_m2n"), {"delta": True}),
    "broadcast": (Layout(trainers=2, tp=2, backend="weightsync_nccl"), {}),
    "ipc": (Layout(trainers=2, tp=2, backend="weightsync_ipc"), {}),
}


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(KEY_COUNT_CASES))
def test_store_key_count_after_100_syncs_equals_the_count_after_2(cluster, case):
    layout, fields = KEY_COUNT_CASES[case]
    cluster.setup(layout)
    wire = {"wire_dtype": "bfloat16"} if fields.get("delta") else {}
    cluster.make_engines(init_info(layout.backend, layout,
                                   buffer_bytes=1 << 15 if layout.backend == "weightsync_m2n" else 1 << 16,
                                   **fields), **wire)
    counts = []
    for n in range(1, 101):
        stats = cluster.sync(f"v{n}", verify=n % 2 == 0)
        if n in (2, 100):
            counts.append(cluster.active_trainers[0].call("test_control_contract:store_keys"))
    if fields.get("delta"):
        assert stats["delta"]["base"] == 99
    assert counts[0] == counts[1], counts  # (syncs 2 and 100 are both verified)
