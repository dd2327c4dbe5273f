"""Control-plane clients: how trainer rank 0 drives the inference side.

``WeightSyncClient`` is structural (four blocking calls on plain dicts), like vLLM's
``VLLMWeightSyncClient``. Every call fans out to every engine (replica) and raises
``RemoteCallError`` carrying the remote error text when any of them fails.
"""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
import weakref
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, ClassVar, Protocol, runtime_checkable

from .errors import EngineDead, RemoteCallError, Unauthorized
from .llm_calls import (
    call_method,
    get_partial,
    is_llm,
    llm_is_paused,
    llm_pause,
    llm_release,
    llm_resume,
    remote_call_error,
    set_partial,
    stop_engine_core,
    watched,
)
from .pausing import PAUSE_MODES, UpdateTracker, WeightsPartlyApplied, _check_mode, partly_applied_message, paused

__all__ = ["WeightSyncClient", "EngineMembership", "RemoteCallError", "EngineDead", "per_engine",
           "HTTPVLLMWeightSyncClient", "RayVLLMWeightSyncClient", "paused", "PAUSE_MODES", "WeightsPartlyApplied"]

UpdatePayload = dict[str, Any] | list[dict[str, Any]]
TOKEN_ENV = "WEIGHTSYNC_HTTP_TOKEN"
"""Where a ``vllm serve`` front with weightsync's middleware reads its token (``integrations.vllm_http``)."""


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
    there).

    Syncs also need ``generation_paused() -> dict[str, bool]`` (engine label -> paused), unless the
    init info says ``require_paused=False`` (:mod:`weightsync.pausing`); weightsync's clients also
    have ``pause_generation``/``resume_generation``."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: UpdatePayload) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class EngineMembership:
    """Which engines a client drives, changeable between syncs (``on_engine_failure="drop"``,
    docs/elastic.md): the trainer engine's ``add_engines`` / ``remove_engines`` call these on rank 0,
    and ``for_engines`` gives it a client of one replica's engine for that replica's group."""

    _engines_attr: ClassVar[str]

    @property
    def engines(self) -> list[Any]:
        """The engines this client drives (handles or URLs), in ``engine_index`` order."""
        return list(getattr(self, self._engines_attr))

    def _checked(self, engines: Any) -> list[Any]:
        """``engines`` as a list, each as this client keeps it (``ValueError`` naming ``engines[i]``)."""
        return list(engines) if isinstance(engines, (list, tuple)) else [engines]

    def _index(self, engine: Any) -> int | None:
        return next((k for k, e in enumerate(getattr(self, self._engines_attr)) if e is engine or e == engine), None)

    def add_engines(self, engines: Any) -> None:
        """Drive ``engines`` too (after those it drives). A duplicate is refused, naming it."""
        new = self._checked(engines)
        for k, e in enumerate(new):
            if self._index(e) is not None or any(e is o or e == o for o in new[:k]):
                raise ValueError(f"engines[{k}]: {e!r} is already one of this client's engines")
        getattr(self, self._engines_attr).extend(new)

    def remove_engines(self, engines: Any) -> None:
        """Stop driving ``engines`` (each must be one of this client's)."""
        gone = self._checked(engines)
        for k, e in enumerate(gone):
            if self._index(e) is None:
                raise ValueError(f"engines[{k}]: {e!r} is not one of this client's engines")
        for e in gone:
            del getattr(self, self._engines_attr)[self._index(e)]

    def for_engines(self, engines: Any) -> Any:
        """A client of the same kind and settings that drives ``engines`` only."""
        c = copy.copy(self)
        setattr(c, self._engines_attr, self._checked(engines))
        if hasattr(c, "_tracker"):
            c._tracker = UpdateTracker()
        return c


class HTTPVLLMWeightSyncClient(EngineMembership):
    """Talks to one or more ``vllm serve`` instances over their RL routes, JSON only (no pickle).

    The server mounts those routes with ``VLLM_SERVER_DEV_MODE=1``; start it with
    ``--weight-transfer-config '{"backend": "weightsync"}'`` and
    ``--middleware weightsync.integrations.vllm_http.WeightSyncRequestValidation`` so that malformed
    bodies get a 400 naming the field and out-of-order calls a 409 (``integrations.vllm_http``).

    Args:
        base_url: ``http://host:port`` or a list of them (one per replica).
        timeout_s: per-request limit.
        token: sent as ``X-Weightsync-Token`` when the servers require one (``WEIGHTSYNC_HTTP_TOKEN``);
            without it, or with another, they answer 401 and the call raises ``Unauthorized``.
    """

    concurrent_calls = True
    _engines_attr = "base_urls"

    def __init__(self, base_url: str | list[str], *, timeout_s: float = 300.0, token: str | None = None) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls or any(not isinstance(u, str) or not u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"base_url must be http(s) URL(s), got {base_url!r}")
        self.base_urls = self._checked(urls)
        self.timeout_s = timeout_s
        self.token = token

    def _checked(self, engines: Any) -> list[str]:
        urls = [engines] if isinstance(engines, str) else list(engines)
        for k, u in enumerate(urls):
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ValueError(f"engines[{k}] must be an http(s) URL, got {u!r}")
        return [u.rstrip("/") for u in urls]

    def _headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", **({"X-Weightsync-Token": self.token} if self.token else {})}

    def _http_error(self, request: str, e: urllib.error.HTTPError) -> RemoteCallError:
        """``RemoteCallError`` with the server's answer; ``Unauthorized`` for a 401 (the token)."""
        detail = e.read().decode(errors="replace")
        if e.code != 401:
            return RemoteCallError(f"{request} -> HTTP {e.code}: {detail}")
        sent = "a token that is not the server's" if self.token else "no token"
        return Unauthorized(f"{request} -> HTTP 401: the server requires its weight-transfer token and this client "
                            f"sent {sent}: pass token=<the server's {TOKEN_ENV}> to HTTPVLLMWeightSyncClient "
                            f"(server said: {detail})")

    def _post_one(self, url: str, path: str, body: dict[str, Any] | None) -> Any:
        data = json.dumps(body if body is not None else {}).encode()
        req = urllib.request.Request(f"{url}/{path}", data=data, method="POST", headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise self._http_error(f"POST {url}/{path}", e) from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise RemoteCallError(f"POST {url}/{path} failed: {e}") from None
        return json.loads(raw) if raw else None

    def _get_one(self, url: str, path: str) -> Any:
        req = urllib.request.Request(f"{url}/{path}", method="GET", headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise self._http_error(f"GET {url}/{path}", e) from None
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
            raise RemoteCallError(f"GET {url}/{path} failed: {e}") from None

    def _post(self, path: str, body: dict[str, Any] | None = None,
              bodies: list[dict[str, Any]] | None = None) -> None:
        """POST to every server at once; the first failure is raised at once (a server that died fails
        the call without waiting for the others, which finish in the background within ``timeout_s``)."""
        bodies = bodies or [body] * len(self.base_urls)  # type: ignore[list-item]
        pool = ThreadPoolExecutor(len(self.base_urls))
        try:
            futures = [pool.submit(self._post_one, u, path, b) for u, b in zip(self.base_urls, bodies)]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f in done and f.exception() is not None:
                    f.result()
            for f in futures:
                f.result()
        finally:
            pool.shutdown(wait=False)

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
        """POST /resume; ``WeightsPartlyApplied`` when a server refuses it (409 from weightsync's
        middleware: a failed sync left its weights partly applied)."""
        try:
            self._post("resume")
        except RemoteCallError as e:
            if "resume_generation refused" in str(e):
                raise WeightsPartlyApplied(str(e)) from None
            raise

    def generation_paused(self) -> dict[str, bool]:
        """GET /is_paused of every server: ``{"engine i (url)": paused}``."""
        with ThreadPoolExecutor(len(self.base_urls)) as pool:
            answers = list(pool.map(lambda u: self._get_one(u, "is_paused"), self.base_urls))
        bad = [u for u, a in zip(self.base_urls, answers) if not isinstance(a, dict) or
               not isinstance(a.get("is_paused"), bool)]
        if bad:
            raise RemoteCallError(f"GET {bad[0]}/is_paused did not answer {{'is_paused': bool}}")
        return {f"engine {i} ({u})": a["is_paused"] for i, (u, a) in enumerate(zip(self.base_urls, answers))}


class RayVLLMWeightSyncClient(EngineMembership):
    """Talks to one or more vLLM ``LLM`` Ray actors (one per replica); Ray is imported on use.

    Pausing: an actor's own ``pause_generation``/``resume_generation``/``is_paused`` methods when it
    has them (e.g. one wrapping ``AsyncLLM``), else, for vLLM's ``LLM`` itself, its engine core's
    scheduler (``pause_scheduler``, as ``AsyncLLM.pause_generation`` does). Whether a failed sync left
    an actor's weights partly applied is kept on the actor (:mod:`weightsync.pausing`)."""

    concurrent_calls = True
    _engines_attr = "handles"

    def __init__(self, handle: Any, *, timeout_s: float = 300.0) -> None:
        self.handles = list(handle) if isinstance(handle, (list, tuple)) else [handle]
        if not self.handles:
            raise ValueError("handle must be an actor handle or a non-empty list of them")
        self.timeout_s = timeout_s
        self._tracker = UpdateTracker()
        self._llm: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()  # handle -> vLLM's LLM?

    def _get(self, method: str, refs: list[Any]) -> list[Any]:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.RayError as e:
            raise remote_call_error(method, e) from None

    def _llms(self, method: str) -> list[bool]:
        """Per handle, whether the actor is vLLM's ``LLM`` (asked once per handle): its calls are
        ``watched`` (a dead engine core fails them at once), other actors' run as they are."""
        new = [h for h in self.handles if h not in self._llm]
        self._llm.update(zip(new, self._get(method, [h.__ray_call__.remote(is_llm) for h in new])))
        return [self._llm[h] for h in self.handles]

    def _call(self, method: str, *args: Any, per_handle: list[tuple[Any, ...]] | None = None) -> None:
        refs = []
        for i, (h, llm) in enumerate(zip(self.handles, self._llms(method))):
            a = per_handle[i] if per_handle else args
            refs.append(h.__ray_call__.remote(watched, call_method, method, *a) if llm
                        else getattr(h, method).remote(*a))
        self._get(method, refs)

    def _on_actors(self, method: str, fn: Any, *args: Any) -> list[Any]:
        """``fn(actor, *args)`` inside every actor."""
        return self._get(method, [h.__ray_call__.remote(fn, *args) for h in self.handles])

    def _own_or_llm(self, method: str, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The actors' own ``method`` where they have it, else ``fn(llm, *args)`` on vLLM's ``LLM``."""
        refs = []
        for h in self.handles:
            try:
                own = getattr(h, method)
            except AttributeError:
                refs.append(h.__ray_call__.remote(watched, fn, *args, *kwargs.values()))
            else:
                refs.append(own.remote(*args, **kwargs))
        return self._get(method, refs)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Each engine gets the init info with its ``engine_index`` (see ``per_engine``)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._call("init_weight_transfer_engine", per_handle=[
            (WeightTransferInitRequest(init_info=d),) for d in per_engine(init_info, len(self.handles))])
        self._tracker.init(init_info)

    def start_weight_update(self) -> None:
        self._tracker.start()
        self._call("start_weight_update")

    def update_weights(self, update_info: UpdatePayload) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if (partial := self._tracker.update(update_info)) is not None:  # before the abort reaches the workers
            self._on_actors("update_weights", set_partial, partial)
        self._call("update_weights", WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)
        if self._tracker.landed():
            self._on_actors("finish_weight_update", set_partial, None)

    def shutdown_weight_transfer_engine(self) -> None:
        """Every actor's workers release their trainer connection (the actor's own method where it has
        one, else, for vLLM's ``LLM``, its workers' through ``collective_rpc``, as ``AsyncLLM`` does)."""
        self._own_or_llm("shutdown_weight_transfer_engine", llm_release)

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause every actor's generation (see ``PAUSE_MODES``)."""
        _check_mode(mode)
        self._own_or_llm("pause_generation", llm_pause, mode=mode, clear_cache=clear_cache)

    def resume_generation(self) -> None:
        """Resume every actor's generation; ``WeightsPartlyApplied`` (nothing resumed) while a failed
        sync left any actor's weights partly applied."""
        partial = self._on_actors("resume_generation", get_partial)
        if torn := [(i, p) for i, p in enumerate(partial) if p is not None]:
            i, reason = torn[0]
            raise WeightsPartlyApplied(partly_applied_message(f"engine {i} ({self.handles[i]})", reason))
        self._own_or_llm("resume_generation", llm_resume)

    def generation_paused(self) -> dict[str, bool]:
        """``{"engine i (actor)": paused}`` for every actor."""
        states = self._own_or_llm("is_paused", llm_is_paused)
        return {f"engine {i} ({h})": bool(p) for i, (h, p) in enumerate(zip(self.handles, states))}

    def shutdown_engines(self, *, timeout_s: float = 60.0) -> None:
        """Stop every engine for good: vLLM's engine core and its workers shut down inside each actor
        (their shared memory in /dev/shm unlinked, as vLLM does at exit), then the actor is killed.
        ``ray.kill`` alone leaves the engine's shared memory behind. A dead engine core is cleaned up
        the same way; an actor that does not answer within ``timeout_s`` is killed all the same."""
        import ray

        refs = [h.__ray_call__.remote(stop_engine_core, timeout_s) for h in self.handles]
        for ref in refs:
            try:
                ray.get(ref, timeout=timeout_s + 10)
            except ray.exceptions.RayError:  # a dead or stuck actor: killed below all the same
                pass
        for h in self.handles:
            ray.kill(h, no_restart=True)
