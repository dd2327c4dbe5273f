"""``LocalWeightSyncClient``: drives receiver processes exactly as vLLM's ``LLM`` drives its workers.

Each call runs the matching worker method on every worker of every replica concurrently
(vLLM's ``collective_rpc``: every request goes out before any reply is read) and blocks until all
returned. Picklable: it holds only addresses, so trainer rank 0 can use it from its own process.
"""

from __future__ import annotations

from typing import Any

from ..clients import RemoteCallError, per_engine
from .actors import ActorAddress, call_many

__all__ = ["LocalWeightSyncClient"]

_RECEIVER = "weightsync.testing.receiver:"


class LocalWeightSyncClient:
    """Args:
        replicas: per replica, the addresses of its TP workers in rank order.
        timeout_s: per-call limit.
    """

    concurrent_calls = True
    """Calls from several threads at once are safe (each takes its own connections)."""

    def __init__(self, replicas: list[list[ActorAddress]], *, timeout_s: float = 600.0) -> None:
        if not replicas or any(not r for r in replicas):
            raise ValueError("replicas must be a non-empty list of non-empty worker lists")
        self.replicas = [list(r) for r in replicas]
        self.timeout_s = timeout_s

    @property
    def workers(self) -> list[ActorAddress]:
        return [a for r in self.replicas for a in r]

    def _fan(self, method: str, *args: Any, per_replica: list[tuple[Any, ...]] | None = None) -> list[Any]:
        calls = [(a, _RECEIVER + method, per_replica[i] if per_replica else args, {})
                 for i, r in enumerate(self.replicas) for a in r]
        outcomes = call_many(calls, timeout_s=self.timeout_s)
        errors = [f"{a.name}: {o}" for a, o in zip(self.workers, outcomes) if isinstance(o, BaseException)]
        if errors:
            raise RemoteCallError(f"{method} failed on {len(errors)} worker(s): " + "\n".join(errors))
        return outcomes

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Each replica (a separate engine) gets the init info with its ``engine_index``."""
        self._fan("init_weight_transfer_engine",
                  per_replica=[(d,) for d in per_engine(init_info, len(self.replicas))])

    def start_weight_update(self) -> None:
        self._fan("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._fan("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._fan("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._fan("shutdown_weight_transfer_engine")

    def weight_versions(self) -> list[str | None]:
        return self._fan("weight_version")
