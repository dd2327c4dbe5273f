"""Control-plane clients: how trainer rank 0 drives the inference side.

``WeightSyncClient`` is structural (four blocking calls on plain dicts), like vLLM's
``VLLMWeightSyncClient``. Every call fans out to every engine (replica) and raises
``RemoteCallError`` carrying the remote error text when any of them fails.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

from .errors import EngineDead, RemoteCallError

__all__ = ["WeightSyncClient", "RemoteCallError", "EngineDead", "per_engine", "HTTPVLLMWeightSyncClient",
           "RayVLLMWeightSyncClient", "paused", "PAUSE_MODES"]

PAUSE_MODES = ("abort", "wait", "keep")
"""How vLLM treats in-flight requests while paused for a sync:
``abort`` drops them now (fastest; the caller re-submits); ``wait`` lets them finish first (no lost
work, the sync waits for the longest request); ``keep`` freezes them in the queue and resumes them
afterwards (their KV caches were computed with the old weights)."""


def _check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")

UpdatePayload = dict[str, Any] | list[dict[str, Any]]


def per_engine(init_info: dict[str, Any], num_engines: int) -> list[dict[str, Any]]:
    """The init info as each of ``num_engines`` separate engines gets it: with its ``engine_index``
    and ``num_engines`` (every separate engine has vLLM's ``data_parallel_index == 0``, so this is
    how its workers learn which replica they are)."""
    return [{**init_info, "engine_index": i, "num_engines": num_engines} for i in range(num_engines)]


@runtime_checkable
class WeightSyncClient(Protocol):
    """The four control-plane calls trainer rank 0 makes. All block until every engine is done.

    A client may also set ``concurrent_calls = True`` (absent: False) when it may be called from two
    threads at once, as weightsync's clients are: trainer rank 0 then sends ``finish_weight_update``
    as soon as every worker said on the store that it applied the update, while the ``update_weights``
    call is still returning (an engine runs its calls in order, so the finish comes after the update
    there)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: UpdatePayload) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class HTTPVLLMWeightSyncClient:
    """Talks to one or more ``vllm serve`` instances over their RL routes, JSON only (no pickle).

    The server mounts those routes with ``VLLM_SERVER_DEV_MODE=1``; start it with
    ``--weight-transfer-config '{"backend": "weightsync"}'`` and
    ``--middleware weightsync.integrations.vllm_http.WeightSyncRequestValidation`` so that malformed
    bodies get a 400 naming the field and out-of-order calls a 409 (``integrations.vllm_http``).

    Args:
        base_url: ``http://host:port`` or a list of them (one per replica).
        timeout_s: per-request limit.
        token: sent as ``X-Weightsync-Token`` when the servers require one (``WEIGHTSYNC_HTTP_TOKEN``).
    """

    concurrent_calls = True

    def __init__(self, base_url: str | list[str], *, timeout_s: float = 300.0, token: str | None = None) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls or any(not isinstance(u, str) or not u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"base_url must be http(s) URL(s), got {base_url!r}")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.token = token

    def _headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", **({"X-Weightsync-Token": self.token} if self.token else {})}

    def _post_one(self, url: str, path: str, body: dict[str, Any] | None) -> Any:
        data = json.dumps(body if body is not None else {}).encode()
        req = urllib.request.Request(f"{url}/{path}", data=data, method="POST", headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise RemoteCallError(f"POST {url}/{path} -> HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise RemoteCallError(f"POST {url}/{path} failed: {e}") from None
        return json.loads(raw) if raw else None

    def _post(self, path: str, body: dict[str, Any] | None = None,
              bodies: list[dict[str, Any]] | None = None) -> None:
        bodies = bodies or [body] * len(self.base_urls)  # type: ignore[list-item]
        with ThreadPoolExecutor(len(self.base_urls)) as pool:
            for f in [pool.submit(self._post_one, u, path, b) for u, b in zip(self.base_urls, bodies)]:
                f.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Each engine gets the init info with its ``engine_index`` (see ``per_engine``)."""
        self._post("init_weight_transfer_engine",
                   bodies=[{"init_info": d} for d in per_engine(init_info, len(self.base_urls))])

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info: UpdatePayload) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": weight_version} if weight_version is not None else None)

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """POST /pause: stop serving before a sync (see ``PAUSE_MODES``); ``clear_cache`` drops
        KV/prefix caches computed with the old weights (ignored by vLLM for ``keep``)."""
        _check_mode(mode)
        self._post(f"pause?mode={mode}&clear_cache={str(bool(clear_cache)).lower()}")

    def resume_generation(self) -> None:
        self._post("resume")


class RayVLLMWeightSyncClient:
    """Talks to one or more vLLM ``LLM`` Ray actors (one per replica); Ray is imported on use."""

    concurrent_calls = True

    def __init__(self, handle: Any, *, timeout_s: float = 300.0) -> None:
        self.handles = list(handle) if isinstance(handle, (list, tuple)) else [handle]
        if not self.handles:
            raise ValueError("handle must be an actor handle or a non-empty list of them")
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any, per_handle: list[tuple[Any, ...]] | None = None) -> None:
        import ray

        refs = [getattr(h, method).remote(*(per_handle[i] if per_handle else args)) for i, h in enumerate(self.handles)]
        try:
            ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.RayError as e:
            raise remote_call_error(method, e) from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Each engine gets the init info with its ``engine_index`` (see ``per_engine``)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._call("init_weight_transfer_engine", per_handle=[
            (WeightTransferInitRequest(init_info=d),) for d in per_engine(init_info, len(self.handles))])

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: UpdatePayload) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._call("update_weights", WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """``AsyncLLM.pause_generation`` on every actor (see ``PAUSE_MODES``)."""
        _check_mode(mode)
        import ray

        refs = [h.pause_generation.remote(mode=mode, clear_cache=clear_cache) for h in self.handles]
        try:
            ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.RayError as e:
            raise remote_call_error("pause_generation", e) from None

    def resume_generation(self) -> None:
        self._call("resume_generation")

    def shutdown_engines(self, *, timeout_s: float = 60.0) -> None:
        """Stop every engine for good: vLLM's engine core and its workers shut down inside each actor
        (their shared memory in /dev/shm unlinked, as vLLM does at exit), then the actor is killed.
        ``ray.kill`` alone leaves the engine's shared memory behind. A dead engine core is cleaned up
        the same way; an actor that does not answer within ``timeout_s`` is killed all the same."""
        import ray

        refs = [h.__ray_call__.remote(_stop_engine_core, timeout_s) for h in self.handles]
        for ref in refs:
            try:
                ray.get(ref, timeout=timeout_s + 10)
            except ray.exceptions.RayError:  # a dead or stuck actor: killed below all the same
                pass
        for h in self.handles:
            ray.kill(h, no_restart=True)


def _stop_engine_core(llm: Any, timeout_s: float) -> None:
    """Inside an ``LLM`` actor: vLLM's own engine-core shutdown (processes joined, queues unlinked)."""
    llm.llm_engine.engine_core.shutdown(timeout=timeout_s)


def remote_call_error(method: str, error: BaseException) -> RemoteCallError:
    """What a failed call on an ``LLM`` actor raises: the remote exception and where it was raised,
    without the actor's repr Ray adds (``LLM``'s prints the whole model); ``EngineDead`` when vLLM's
    engine core died (the actor lives, every later call fails the same way)."""
    cause = getattr(error, "cause", None)
    if not isinstance(cause, BaseException):
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return RemoteCallError(f"{method} failed on an inference actor: {type(error).__name__}: {first[:500]}")
    chain = [cause]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(nxt)
    where = _innermost_frame(getattr(error, "traceback_str", "") or "")
    if any(type(c).__name__ == "EngineDeadError" for c in chain):
        return EngineDead(f"{method} failed on an inference actor: vLLM's engine core is dead ({type(cause).__name__}: "
                          f"{cause}); the actor is alive, but every call fails until the engine restarts: restart the "
                          "engine, then trainer_init")
    return RemoteCallError(f"{method} failed on an inference actor: {type(cause).__name__}: {cause}{where}")


def _innermost_frame(traceback_str: str) -> str:
    """`` (at File "...", line N, in f)``: the last frame of a remote traceback, or nothing."""
    frames = [ln.strip() for ln in traceback_str.splitlines() if ln.strip().startswith("File ")]
    return f" (at {frames[-1]})" if frames else ""


@contextmanager
def paused(client: Any, mode: str = "abort", clear_cache: bool = True) -> Iterator[None]:
    """Pause generation for the body (a sync) and resume afterwards::

        with paused(client, mode="wait"):
            engine.send_weights(weight_version=f"step{step}")

    When the body raises a ``SyncFailed`` whose engines may hold partly updated weights
    (``restored`` False: the default ``rollback=False`` and data had moved), generation stays
    paused: re-initialize, sync again (inside ``paused`` again, which resumes on success), or call
    ``client.resume_generation()`` yourself. Any other failure resumes generation."""
    client.pause_generation(mode=mode, clear_cache=clear_cache)
    try:
        yield
    except BaseException as e:
        if getattr(e, "restored", True):
            client.resume_generation()
        raise
    client.resume_generation()
