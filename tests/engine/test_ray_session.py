"""The Ray cluster the harness, ``weightsync demo`` and the examples' ``--cpu`` modes start
(``weightsync.testing.vllm_cpu.RaySession``), issue 56 item 4: on the loopback address, with Ray's own
token authentication as Ray defaults it (not disabled).

While an engine runs (its ``LLM`` actor, engine core and workers up, the trainer actors alive), every
listening socket of Ray's processes (the GCS, the raylet, Ray's agents, the driver's and every worker's
core worker: this process and the ``ray::`` processes under it) is bound to a loopback address.
"""

from __future__ import annotations

import ipaddress
import os

import pytest
from engine_support import EngineConfig, start_engines

pytestmark = pytest.mark.timeout(900)

ENGINE = EngineConfig("weightsync", 2, "bfloat16", "tiny_qwen3")  # test_engine_delta's engine (reused)
RAY_NAMES = ("gcs_server", "raylet")
"""Ray's own executables."""


@pytest.fixture(scope="module")
def engine(ray_session):
    return start_engines(ray_session, ENGINE, reuse=True)[0]


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a dual-stack socket bound to loopback
    return (mapped or addr).is_loopback


def listening(pids: dict[int, str]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``pids`` (pid -> name)."""
    import psutil

    return sorted((pids[c.pid], c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN and c.pid in pids)


def ray_processes() -> dict[int, str]:
    """This process (the driver) and every Ray process under it (Ray starts its cluster as our children): its
    executables, its Python processes (dashboard, monitors, agents: run from Ray's package) and its workers
    (titled ``ray::...``), not vLLM's engine processes under the engine actor."""
    import psutil

    me = psutil.Process()
    out = {me.pid: "driver"}
    for p in me.children(recursive=True):
        try:
            name, cmd = p.name(), p.cmdline()
        except psutil.Error:  # gone meanwhile
            continue
        title = " ".join(cmd[:1])
        script = next((a for a in cmd[1:3] if a.endswith(".py")), "")
        if name in RAY_NAMES:
            out[p.pid] = name
        elif title.startswith("ray::"):
            out[p.pid] = title
        elif f"{os.sep}ray{os.sep}" in script:
            out[p.pid] = "ray " + os.path.basename(script)
    return out


def test_ray_listens_on_loopback_only_and_keeps_its_token_auth_while_an_engine_runs(ray_session, engine,
                                                                                   trainer_actors):
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    from weightsync.testing.vllm_cpu import ENGINE_ENV

    assert ray.get([engine.ready.remote()] + [a.ready.remote() for a in trainer_actors], timeout=300)
    assert ray_session.node_ip == "127.0.0.1" and ray.util.get_node_ip_address() == "127.0.0.1"
    assert "RAY_AUTH_MODE" not in ENGINE_ENV and is_token_auth_enabled(), "Ray's token auth (its default) is on"
    assert os.environ.get("RAY_AUTH_MODE") == "token", "Ray enabled it for this cluster itself"
    procs = ray_processes()
    sockets = listening(procs)
    names = {name for name, _, _ in sockets}
    assert {"gcs_server", "raylet", "driver"} <= names, sockets  # the check sees Ray's ports: it can fail
    assert any(n.startswith("ray::EngineActor") for n in names), sockets
    wide = [s for s in sockets if not _loopback(s[1])]
    assert wide == [], f"Ray ports listening beyond loopback: {wide}"
    print(f"{len(sockets)} Ray sockets, all on loopback:", sockets)
