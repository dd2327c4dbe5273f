"""Inside a harness process (a trainer or receiver actor, called by name): count what each NIXL agent of
:class:`~weightsync.dataplane.nixl.NixlPlane` does, and list what the process holds (listening TCP
sockets, /dev/shm mappings and descriptors, threads), so a test can see whose state a membership change
built and that nothing is left after a shutdown."""

from __future__ import annotations

import os
import weakref
from collections import Counter
from typing import Any

COUNTED = ("add_remote_agent", "remove_remote_agent", "register_memory", "deregister_memory",
           "get_agent_metadata", "get_partial_agent_metadata", "initialize_xfer")
"""Agent calls counted: metadata exchanges, registrations and transfer requests."""

_AGENTS: list[tuple[str, Counter[str], Any]] = []  # (agent name, calls, weak reference to the agent's proxy)


class _Counted:
    """A NIXL agent whose ``COUNTED`` calls are counted; everything else passes through."""

    def __init__(self, agent: Any, calls: Counter[str]) -> None:
        self._agent, self._calls = agent, calls

    def __getattr__(self, attr: str) -> Any:
        fn = getattr(self._agent, attr)
        if attr not in COUNTED:
            return fn

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls[attr] += 1
            return fn(*args, **kwargs)
        return counted


def count_agents() -> None:
    """From now on every agent a ``NixlPlane`` of this process makes is counted (earlier ones are forgotten)."""
    import weightsync.dataplane.nixl as nixl

    original = getattr(nixl.new_agent, "counted_original", nixl.new_agent)

    def new_agent(name: str) -> Any:
        calls: Counter[str] = Counter()
        proxy = _Counted(original(name), calls)
        _AGENTS.append((name, calls, weakref.ref(proxy)))
        return proxy

    new_agent.counted_original = original  # type: ignore[attr-defined]
    nixl.new_agent = new_agent  # type: ignore[assignment]
    _AGENTS.clear()


def agents() -> list[dict[str, Any]]:
    """Every counted agent, in the order they were made: its name, its calls, whether it is still held."""
    return [{"name": name, "calls": dict(calls), "held": ref() is not None} for name, calls, ref in _AGENTS]


def _listening_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        inodes |= {cols[9] for cols in (r.split() for r in rows) if cols[3] == "0A"}  # 0A: LISTEN
    return inodes


def resources() -> dict[str, Any]:
    """This process's listening TCP sockets (by local address), its /dev/shm mappings and descriptors,
    and its thread count."""
    listening = _listening_inodes()
    socks, shm_fds = [], []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in listening:
            socks.append(target[8:-1])
        elif target.startswith("/dev/shm/"):
            shm_fds.append(target)
    with open("/proc/self/maps") as f:
        shm_maps = sorted({line.split(None, 5)[5].strip() for line in f
                           if len(line.split(None, 5)) == 6 and "/dev/shm/" in line})
    return {"listening": len(socks), "shm_fds": sorted(shm_fds), "shm_maps": shm_maps,
            "threads": len(os.listdir("/proc/self/task"))}
