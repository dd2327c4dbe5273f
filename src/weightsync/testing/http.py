"""vLLM's own RL HTTP router (FastAPI) on loopback, inside an actor process, whose engine client
forwards to harness receiver processes: requests are parsed by vLLM's own route signatures and
request types, and land on real worker engines.

``actor.call("weightsync.testing.http:start", replicas, port)`` (an actor with ``VLLM_CPU_ENV``),
then ``HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{port}")``; ``calls`` lists what arrived.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from .actors import STATE, ActorAddress
from .client import LocalWeightSyncClient

__all__ = ["start", "calls", "stop"]


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

    async def get_weight_version(self):
        return self.version

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self):
        self.calls.append(("resume",))


def start(replicas: list[list[ActorAddress]], port: int) -> None:
    """Serve vLLM's RL routes on ``127.0.0.1:port`` in front of ``replicas`` (receiver addresses)."""
    import uvicorn
    from fastapi import FastAPI
    from vllm.entrypoints.rl.online.api_router import router

    app = FastAPI()
    app.include_router(router)
    app.state.engine_client = _EngineClient(LocalWeightSyncClient(replicas))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("uvicorn did not start")
    STATE["http"] = (server, app.state.engine_client)


def calls() -> list[tuple[Any, ...]]:
    """The engine-client calls the routes made so far, in order."""
    return STATE["http"][1].calls


def stop() -> None:
    server, _ = STATE.pop("http")
    server.should_exit = True
