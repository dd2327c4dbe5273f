"""``LocalWeightSyncClient``: drives receiver processes exactly as vLLM's ``LLM`` drives its workers.

Each call runs the matching worker method on every worker of every replica concurrently
(vLLM's ``collective_rpc``: every request goes out before any reply is read) and blocks until all
returned, or until one worker process is lost: like vLLM's executor, which fails every call once a
worker died, the call then raises at once naming it. Picklable: it holds only addresses, so trainer
rank 0 can use it from its own process.

``serve_http``: vLLM's own RL HTTP router (FastAPI) on loopback, inside an actor process, whose engine
client forwards to a ``LocalWeightSyncClient``: requests are parsed by vLLM's own route signatures and
request types, and land on real worker engines. ``actor.call("weightsync.testing.client:serve_http",
replicas, port)`` (an actor with ``VLLM_CPU_ENV``), then ``HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{port}")``;
``http_calls`` lists what arrived.

Pausing (:mod:`weightsync.pausing`): each receiver process holds its engine's pause state and whether a
failed sync left its weights partly applied (``STATE``), so every client of the same receivers sees them;
a replica (engine) is paused when all its workers are.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from ..clients import EngineMembership, per_engine
from ..errors import RemoteCallError
from ..pausing import UpdateTracker, WeightsPartlyApplied, _check_mode, partly_applied_message
from .actors import STATE, ActorAddress, NotAwaited, call_many

__all__ = ["LocalWeightSyncClient", "serve_http", "http_calls"]

_RECEIVER = "weightsync.testing.receiver:"
_HERE = "weightsync.testing.client:"
_PAUSED, _PARTIAL = "weightsync_paused", "weightsync_partly_applied"


class LocalWeightSyncClient(EngineMembership):
    """Args:
        replicas: per replica, the addresses of its TP workers in rank order.
        timeout_s: per-call limit.
    """

    concurrent_calls = True
    """Calls from several threads at once are safe (each takes its own connections)."""
    _engines_attr = "replicas"
    """An engine is a replica: the list of its workers' addresses."""

    def __init__(self, replicas: list[list[ActorAddress]], *, timeout_s: float = 600.0) -> None:
        if not replicas or any(not r for r in replicas):
            raise ValueError("replicas must be a non-empty list of non-empty worker lists")
        self.replicas = self._checked(replicas)
        self.timeout_s = timeout_s
        self._tracker = UpdateTracker()

    def _checked(self, engines: Any) -> list[list[ActorAddress]]:
        for k, r in enumerate(engines):
            if not isinstance(r, (list, tuple)) or not r:
                raise ValueError(f"engines[{k}] must be a non-empty list of worker addresses, got {r!r}")
        return [list(r) for r in engines]

    @property
    def workers(self) -> list[ActorAddress]:
        return [a for r in self.replicas for a in r]

    def _fan(self, method: str, *args: Any, per_replica: list[tuple[Any, ...]] | None = None,
             fn: str | None = None) -> list[Any]:
        """``fn`` (default: the receiver's ``method``) on every worker; ``method`` names the call in errors."""
        fn = fn or _RECEIVER + method
        calls = [(a, fn, per_replica[i] if per_replica else args, {})
                 for i, r in enumerate(self.replicas) for a in r]
        outcomes = call_many(calls, timeout_s=self.timeout_s, fail_fast=True)
        errors = [f"{a.name}: {o}" for a, o in zip(self.workers, outcomes)
                  if isinstance(o, BaseException) and not isinstance(o, NotAwaited)]
        if errors:
            unread = sum(isinstance(o, NotAwaited) for o in outcomes)
            raise RemoteCallError(f"{method} failed on {len(errors)} worker(s)"
                                  f"{f' ({unread} not waited for)' if unread else ''}: " + "\n".join(errors))
        return outcomes

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Each replica (a separate engine) gets the init info with its ``engine_index``."""
        self._fan("init_weight_transfer_engine",
                  per_replica=[(d,) for d in per_engine(init_info, len(self.replicas))])
        self._tracker.init(init_info)

    def start_weight_update(self) -> None:
        self._tracker.start()
        self._fan("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        partial = self._tracker.update(update_info)
        try:
            if partial is not None:  # marked before the abort reaches the workers
                self._fan("update_weights", _PARTIAL, partial, fn=_HERE + "_set")
        finally:  # a dead worker fails the mark: the abort still reaches every live one
            self._fan("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._fan("finish_weight_update", weight_version, self._tracker.landed(), fn=_HERE + "_finish")

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        _check_mode(mode)
        self._fan("pause_generation", _PAUSED, True, fn=_HERE + "_set")

    def resume_generation(self) -> None:
        """``WeightsPartlyApplied`` (nothing resumed) while a failed sync left any replica's weights
        partly applied; else every replica resumes."""
        partial = self._fan("resume_generation", _PARTIAL, fn=_HERE + "_get")
        if torn := [(a, p) for a, p in zip(self.workers, partial) if p is not None]:
            a, reason = torn[0]
            raise WeightsPartlyApplied(partly_applied_message(f"engine {self._replica_of(a)} ({a.name})", reason))
        self._fan("resume_generation", _PAUSED, False, fn=_HERE + "_set")

    def generation_paused(self) -> dict[str, bool]:
        """``{"engine i (workers)": paused}`` per replica."""
        states = iter(self._fan("generation_paused", _PAUSED, fn=_HERE + "_get"))
        return {f"engine {i} ({', '.join(a.name for a in r)})": all([bool(next(states)) for _ in r])
                for i, r in enumerate(self.replicas)}

    def _replica_of(self, addr: ActorAddress) -> int:
        return next(i for i, r in enumerate(self.replicas) if addr in r)

    def shutdown_weight_transfer_engine(self) -> None:
        self._fan("shutdown_weight_transfer_engine")

    def weight_versions(self) -> list[str | None]:
        return self._fan("weight_version")


# --- vLLM's RL HTTP routes in front of receivers ---------------------------------------------------

class _EngineClient:
    """The slice of vLLM's ``EngineClient`` that the RL router calls."""

    def __init__(self, local: LocalWeightSyncClient) -> None:
        self.local, self.calls, self.version = local, [], None

    async def init_weight_transfer_engine(self, request):
        self.calls.append(("init", type(request).__name__))
        await asyncio.to_thread(self.local.init_weight_transfer_engine, request.init_info)

    async def start_weight_update(self):
        self.calls.append(("start",))
        await asyncio.to_thread(self.local.start_weight_update)

    async def update_weights(self, request):
        self.calls.append(("update", type(request).__name__))
        await asyncio.to_thread(self.local.update_weights, request.update_info)

    async def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))
        await asyncio.to_thread(self.local.finish_weight_update, weight_version)
        if weight_version is not None:
            self.version = weight_version

    async def shutdown_weight_transfer_engine(self):
        self.calls.append(("shutdown",))
        await asyncio.to_thread(self.local.shutdown_weight_transfer_engine)

    async def get_weight_version(self):
        return self.version

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.calls.append(("pause", mode, clear_cache))
        await asyncio.to_thread(self.local.pause_generation, mode, clear_cache)

    async def resume_generation(self):
        self.calls.append(("resume",))
        await asyncio.to_thread(self.local.resume_generation)

    async def is_paused(self):
        return all((await asyncio.to_thread(self.local.generation_paused)).values())


def serve_http(replicas: list[list[ActorAddress]], port: int, token: str | None = None) -> None:
    """Serve vLLM's RL routes on ``127.0.0.1:port`` in front of ``replicas`` (receiver addresses);
    with ``token``, behind weightsync's middleware requiring it (one such server per process)."""
    import uvicorn
    from fastapi import FastAPI
    from vllm.entrypoints.rl.online.api_router import router

    app = FastAPI()
    app.include_router(router)
    if token is not None:
        from ..integrations.vllm_http import WeightSyncRequestValidation

        app.add_middleware(WeightSyncRequestValidation, token=token)
    app.state.engine_client = _EngineClient(LocalWeightSyncClient(replicas))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("uvicorn did not start")
    STATE["http" if token is None else "http_token"] = (server, app.state.engine_client)


def http_calls() -> list[tuple[Any, ...]]:
    """The engine-client calls the routes made so far, in order."""
    return STATE["http"][1].calls


# --- inside a receiver process (the engine's pause and weight state) ---

def _set(key: str, value: Any) -> None:
    STATE[key] = value


def _get(key: str) -> Any:
    return STATE.get(key)


def _finish(weight_version: str | None, landed: bool) -> None:
    """The worker's finish; a finish that completes a full sync clears the partly-applied mark."""
    from . import receiver

    receiver.finish_weight_update(weight_version)
    if landed:
        STATE.pop(_PARTIAL, None)
