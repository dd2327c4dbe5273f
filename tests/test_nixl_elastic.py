"""``weightsync_nixl`` with elastic replicas (issue 53): a replica added with ``add_engines`` builds its
own NIXL state only (agents, metadata exchanges, registrations are counted in every process: the other
replicas' are not touched, and their next sync costs what the one before it did), syncs bit-exact, and
after the shutdown no agent, registration, listening socket or /dev/shm mapping is left in any process.
(A killed replica under ``on_engine_failure="drop"`` failing only its own sync is
``test_elastic.py::test_a_worker_killed_mid_sync_is_dropped_the_others_complete_and_a_new_one_joins``,
run for every elastic transport, this one included.)"""

from __future__ import annotations

from typing import Any

import pytest

from helpers import init_info
from weightsync.dataplane.nixl import nixl_module
from weightsync.testing.actors import gather
from weightsync.testing.client import LocalWeightSyncClient
from weightsync.testing.cluster import Layout

try:
    nixl_module()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm]

BACKEND = "weightsync_nixl"
TIMEOUT_S = 60.0
_R = "weightsync.testing.receiver:"
_C = "nixl_counts:"


def on(actors: list[Any], fn: str) -> list[Any]:
    return gather([a.submit(_C + fn) for a in actors])


def differences(cluster: Any, receivers: list[Any]) -> dict[str, list[str]]:
    sd = cluster.on_trainers("full_state_dict")[0]
    return {r.name: bad for r in receivers if (bad := r.call(_R + "compare_with_oracle", sd))}


def grown(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """An agent's state calls (metadata loaded or given, registrations) between two snapshots; its
    transfer requests are left out: one per peer per look, so their count depends on timing."""
    return {k: n - before["calls"].get(k, 0) for k, n in after["calls"].items()
            if n != before["calls"].get(k, 0) and k != "initialize_xfer"}


def test_an_added_replica_builds_only_its_own_nixl_state_and_nothing_is_left(cluster):
    layout = Layout(trainers=2, tp=1, replicas=2, backend=BACKEND)  # the second replica is added later
    cluster.setup(layout, fresh=True)
    ts, (r0, r1) = cluster.active_trainers, cluster.receivers[:2]
    procs = [*ts, r0, r1]
    baseline = on(procs, "resources")
    on(procs, "count_agents")
    client = LocalWeightSyncClient([[r0.address]], timeout_s=TIMEOUT_S)
    cluster.make_engines(init_info(BACKEND, Layout(trainers=2, tp=1, replicas=1, backend=BACKEND),
                                   timeout_s=TIMEOUT_S, on_engine_failure="drop"), client=client)
    cluster.sync("v1")
    v1 = on(procs, "agents")
    cluster.train_step(1)
    cluster.sync("v2")
    v2 = on(procs, "agents")
    assert [len(a) for a in v2] == [1, 1, 1, 0]  # an agent per trainer rank per replica, one per worker
    steady = [[grown(a, b) for a, b in zip(x, y)] for x, y in zip(v1, v2)]  # a sync once registered

    assert cluster.on_trainers("add_engines", [[r1.address]]) == [[1], [1]]
    added = on(procs, "agents")
    assert [len(a) for a in added] == [2, 2, 1, 1]  # one new agent per trainer rank, one for the new worker
    for old, new in zip(v2, added):
        assert new[:len(old)] == old  # the running replicas' agents: no metadata, registration or transfer more
    assert all(a["held"] for p in added for a in p)

    cluster.train_step(2)
    stats = cluster.sync("v3")
    assert stats["replicas"] == [0, 1] and stats["dropped"] == {}
    assert differences(cluster, [r0, r1]) == {}
    assert [r.call(_R + "weight_version") for r in (r0, r1)] == ["v3"] * 2
    v3 = on(procs, "agents")
    for p, (old, new) in enumerate(zip(added, v3)):
        for i in range(len(v2[p])):  # a running replica's sync builds what its previous one did
            assert grown(old[i], new[i]) == steady[p][i], (p, i, grown(old[i], new[i]), steady[p][i])
    assert v3[2][0]["calls"]["initialize_xfer"] > added[2][0]["calls"]["initialize_xfer"]  # the old worker READ too
    for p in (0, 1):  # the new replica's trainer agents: loaded its worker's metadata and registered what they send
        calls = v3[p][1]["calls"]
        assert calls.get("register_memory", 0) >= 1 and calls.get("add_remote_agent", 0) >= 1, calls
    assert v3[3][0]["calls"].get("initialize_xfer", 0) >= 1  # the new worker READ its weights

    cluster.on_trainers("shutdown_engine")
    cluster.on_receivers("shutdown_weight_transfer_engine")
    end = on(procs, "agents")
    for p in end:
        for a in p:
            assert not a["held"], a  # every agent dropped
            assert a["calls"].get("register_memory", 0) == a["calls"].get("deregister_memory", 0), a
    for name, before, after in zip([a.name for a in procs], baseline, on(procs, "resources")):
        assert after["listening"] <= before["listening"], (name, before, after)
        assert set(after["shm_maps"]) <= set(before["shm_maps"]), (name, before, after)
        assert set(after["shm_fds"]) <= set(before["shm_fds"]), (name, before, after)
