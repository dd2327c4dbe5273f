"""``vllm serve`` middleware: weight-sync requests are validated into weightsync's typed infos in the
API server, before anything reaches a worker (or torch), and refused with a 4xx that names the field::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "weightsync"}' \\
        --middleware weightsync.integrations.vllm_http.WeightSyncRequestValidation

Without it, vLLM's RL routes hand the JSON body to every worker as it came, and every worker error
(a wrongly typed port, an unknown field, an update without a start) comes back as HTTP 500
``Call to collective_rpc method failed: ...``; a bad init info for vLLM's ``weightsync`` backend
has already swapped the worker's transport engine by then. With it:

* ``POST /init_weight_transfer_engine``: the body must be ``{"init_info": {...}}``; the info is parsed
  with the init-info class of the transport it names (or of the server's ``weightsync_*`` backend):
  unknown, missing and wrongly typed fields -> 400, message and ``param`` naming the field.
* ``POST /update_weights``: ``{"update_info": {...} | [{...}, ...]}``, each parsed with the update-info
  class of the transport this server was last initialized for (any weightsync transport's when
  unknown here, e.g. with several API server processes) -> 400 naming the field.
* A worker refusing a call out of order (update or finish without start, start during an update,
  any call before init) -> 409 Conflict with the worker's own words, instead of 500 (vLLM raises
  those as ``RuntimeError`` through the route, answered by Starlette's outermost error handler).

* A worker refusing a start or finish its trainer session did not announce (a call from outside the
  sync, ``WorkerEngine.fence_call``) -> 403 with the worker's words; the update stays tracked as active.
* Limits (``weightsync.integrations.http_limits``), answered before anything reaches a worker: a body
  over ``max_body_bytes`` (``WEIGHTSYNC_HTTP_MAX_BODY_BYTES``, 16 MiB by default) -> 413; JSON nested
  deeper than 16 levels, NaN/Infinity, or any number out of its range (ports, ranks, counts, byte sizes,
  offsets, IPC handle fields) -> 400 naming the field.
* ``POST /init_weight_transfer_engine`` while an update this API server started is active (a 2xx
  ``/start_weight_update`` not yet followed by its ``/finish_weight_update``) -> 409: an init would
  replace the trainer mid-update. (Tracked per API server process: with ``--api-server-count`` > 1
  it is not known here and the init passes.)
* ``POST /resume`` while a failed sync left the weights partly applied -> 409 (:mod:`weightsync.pausing`):
  from an ``/update_weights`` that aborts the update (``update_info.abort``: the trainer gave up on a
  sync it started) under an init without ``rollback`` until the 2xx ``/finish_weight_update`` of an
  update that was not aborted (a full sync landed). Tracked per API server process, like the above.
* With a token (``WEIGHTSYNC_HTTP_TOKEN`` in the server's environment, or ``token=``), every route of
  ``TOKEN_ROUTES`` (weight transfer, pause and resume, caches, profiling, sleep, LoRA adapters,
  elastic scaling, ``collective_rpc``) needs the header ``X-Weightsync-Token: <token>`` -> 401 without
  it. vLLM's own ``--api-key`` guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
  (vLLM 0.33's ``GUARDED_PREFIX``): none of the weight-transfer routes.
* Without a token, a server bound to anything but loopback (``--host`` unset, ``0.0.0.0``, a LAN
  address) refuses every route of ``TOKEN_ROUTES`` -> 403, unless ``allow_no_token=True``
  (``WEIGHTSYNC_HTTP_ALLOW_NO_TOKEN=1``) says the network in front of it is trusted.
* The event loop never parses a body: a body is read here (bounded by ``max_body_bytes``), then
  parsed and validated in a worker thread (``asyncio.to_thread``), so a 16 MiB update never stalls
  the server's other requests. Whether an update aborts is read from the parsed body (a JSON escape
  such as ``"ab\\u006frt"`` is the same field to vLLM and here).

Servers whose backend is not weightsync's pass every body through unchanged (only the 409 mapping,
the size limit and the token apply). Pure ASGI: no vLLM, FastAPI or Starlette import (``import
weightsync`` stays free of them).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..infos import parse_info
from ..pausing import UpdateTracker, partly_applied_message
from ..registry import TRANSPORTS, transport
from .http_limits import LimitError, check_ranges, loads

__all__ = ["WeightSyncRequestValidation", "validate_request", "RequestError", "OUT_OF_ORDER", "TOKEN_ROUTES",
           "TOKEN_ENV", "MAX_BODY_ENV", "TOKEN_HEADER", "ALLOW_NO_TOKEN_ENV"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

ANY = "weightsync"
"""vLLM's worker backend that serves whichever weightsync transport an init info names."""
ROUTES = {"/init_weight_transfer_engine": "init_info", "/update_weights": "update_info"}
"""Route -> the one body field it takes (validated)."""
ORDERED = {"/init_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update", "/update_weights",
           "/finish_weight_update", "/shutdown_weight_transfer_engine"}
"""Routes whose out-of-order refusals are answered 409 (and whose bodies are read here)."""
TOKEN_ROUTES = ORDERED | {"/update_weight_version", "/weight_checker", "/pause",
                          "/resume", "/abort_requests", "/collective_rpc", "/sleep", "/wake_up",
                          "/release_kv_cache_memory", "/reset_prefix_cache", "/reset_mm_cache",
                          "/reset_encoder_cache", "/start_profile", "/stop_profile", "/v1/load_lora_adapter",
                          "/v1/unload_lora_adapter", "/scale_elastic_ep"}
"""vLLM's weight-transfer (RL) routes and the routes that change the engine (caches, profiling, sleep, LoRA
adapters, elastic scaling): they need the token when one is set (every method), and a token (or
``allow_no_token``) on a server bound to anything but loopback."""
TOKEN_ENV, MAX_BODY_ENV = "WEIGHTSYNC_HTTP_TOKEN", "WEIGHTSYNC_HTTP_MAX_BODY_BYTES"
ALLOW_NO_TOKEN_ENV = "WEIGHTSYNC_HTTP_ALLOW_NO_TOKEN"
TOKEN_HEADER = "X-Weightsync-Token"
DEFAULT_MAX_BODY_BYTES = 16 << 20
OUT_OF_ORDER = (
    "start_weight_update must be called before update_weights",           # vLLM's worker
    "start_weight_update called while a weight update is already active",
    "finish_weight_update called without a matching start_weight_update",
    "Cannot release a trainer connection during a weight update",
    "Weight transfer not configured",
    "init_transfer_engine must run before start_weight_update",           # weightsync's workers
    "start_weight_update must run before update_weights",
    "finish_weight_update without start_weight_update",
    "init_weight_transfer_engine must run first",
)
"""Worker errors that mean "call in the wrong order", refused before any weight changed."""
FENCED = "a call its trainer session did not announce"
"""In a worker's refusal of a start or finish its trainer session did not announce (``worker.engine.FENCED``):
answered 403, and the update this server tracks stays active (it is the trainer's, still live)."""
_WORKER_ERROR = re.compile(r"Worker failed with error '(.*)', please check", re.S)
_FIELD = re.compile(r"field '(\w+)'|unknown field\(s\) \['(\w+)'|argument: '(\w+)'|^(?:init|update)_info\.(\w+)")


class RequestError(ValueError):
    """A request body that does not fit; ``param`` is the offending field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _field(message: str) -> str | None:
    m = _FIELD.search(message)
    return next((g for g in m.groups() if g), None) if m else None


def _parse(cls: type, value: Any, what: str) -> Any:
    try:
        return parse_info(cls, value, what)
    except ValueError as e:
        raise RequestError(str(e), _field(str(e))) from None


def _check_ranges(value: Any, what: str) -> None:
    try:
        check_ranges(value, what)
    except LimitError as e:
        raise RequestError(str(e), e.param) from None


def _backend_of(config: Any) -> str | None:
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    return config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)


def validate_request(path: str, body: bytes, backend: str | None, current: str | None = None) -> str | None:
    """Check one RL-route request for a server whose weight-transfer backend is ``backend``;
    ``current`` is the transport last initialized (None: unknown). Returns the transport an init
    request names (None for other routes); raises ``RequestError`` for a body that does not fit."""
    return inspect_request(path, body, backend, current)[0]


def inspect_request(path: str, body: bytes, backend: str | None, current: str | None = None) -> tuple[str | None, Any]:
    """``validate_request``, and the body's field (``init_info`` / ``update_info``) as parsed, None when
    the route takes none or the body is no JSON object (a body a server of another backend gets as it
    came). CPU-bound (a 16 MiB body parses in ~0.4 s): the middleware runs it off the event loop."""
    if path not in ROUTES:
        return None, None
    key = ROUTES[path]
    if not (backend == ANY or backend in TRANSPORTS):  # passed through unchecked; parsed for the abort decision
        try:
            data = loads(body) if body.strip() else None
        except ValueError:
            return None, None
        return None, data.get(key) if isinstance(data, dict) else None
    try:
        data = loads(body) if body.strip() else None
    except LimitError as e:
        raise RequestError(str(e), e.param) from None
    except ValueError as e:
        raise RequestError(f"the request body is not JSON: {e}") from None
    named = _validated(key, data, backend, current)  # (a JSON object holding ``key``, once it returns)
    return named, data[key] if isinstance(data, dict) else None


def _validated(key: str, data: Any, backend: str | None, current: str | None) -> str | None:
    """``validate_request`` of a parsed body."""
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object {{{key!r}: ...}}, got {type(data).__name__}")
    if unknown := sorted(set(data) - {key}):
        raise RequestError(f"unknown field(s) {unknown} in the request body; expected [{key!r}]", unknown[0])
    if key not in data:
        raise RequestError(f"the request body misses the field {key!r}", key)
    value = data[key]
    if key == "init_info":
        if not isinstance(value, dict):
            raise RequestError(f"init_info must be a JSON object, got {type(value).__name__}", key)
        named = value.get("transport")
        if backend == ANY:
            if not isinstance(named, str) or named not in TRANSPORTS:
                raise RequestError(f"init_info.transport must name a weightsync transport for vLLM's 'weightsync' "
                                   f"backend (one of {sorted(TRANSPORTS)}), got {named!r}", "transport")
        elif named not in ("", None, backend):
            raise RequestError(f"init_info.transport is {named!r}, but this server's weight-transfer backend is "
                               f"{backend!r}: start it with --weight-transfer-config "
                               f"'{{\"backend\": \"weightsync\"}}' to serve every weightsync transport", "transport")
        name = named if backend == ANY else backend
        _parse(transport(name).worker_engine.init_info_cls, value, "init_info")
        _check_ranges(value, "init_info")
        return name
    _check_updates(value, key, backend, current)
    return None


def _check_updates(value: Any, key: str, backend: str | None, current: str | None) -> None:
    infos = value if isinstance(value, list) else [value]
    if not infos or not all(isinstance(i, dict) for i in infos):
        raise RequestError("update_info must be a JSON object or a non-empty list of them (one per worker)", key)
    names = [current] if current else [backend] if backend != ANY else sorted(TRANSPORTS)
    classes = list(dict.fromkeys(transport(n).worker_engine.update_info_cls for n in names))
    for i, info in enumerate(infos):
        errors = []
        what = "update_info" if len(infos) == 1 else f"update_info[{i}]"
        for cls in classes:
            try:
                _parse(cls, info, what)
            except RequestError as e:
                errors.append(e)
                continue
            _check_ranges(info, what)  # it fits this class: its numbers must be in range
            break
        else:
            raise errors[0]


def _error_body(message: str, code: int, kind: str, param: str | None = None) -> bytes:
    """vLLM's ``ErrorResponse`` shape."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


class WeightSyncRequestValidation:
    """The ASGI middleware (``vllm serve --middleware weightsync.integrations.vllm_http.WeightSyncRequestValidation``).

    ``backend`` defaults to the server's own (``app.state.args.weight_transfer_config``, read per request);
    ``token`` to ``$WEIGHTSYNC_HTTP_TOKEN`` (unset or empty: no token), ``max_body_bytes`` to
    ``$WEIGHTSYNC_HTTP_MAX_BODY_BYTES`` or 16 MiB; ``allow_no_token`` to ``$WEIGHTSYNC_HTTP_ALLOW_NO_TOKEN``
    being ``1`` (serve ``TOKEN_ROUTES`` without a token on a server bound to anything but loopback)."""

    def __init__(self, app: ASGIApp, backend: str | None = None, token: str | None = None,
                 max_body_bytes: int | None = None, allow_no_token: bool | None = None) -> None:
        self.app = app
        self.backend = backend
        token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self.token = token.encode() if token else None
        if allow_no_token is None:
            allow_no_token = os.environ.get(ALLOW_NO_TOKEN_ENV, "") == "1"
        if not isinstance(allow_no_token, bool):
            raise TypeError(f"allow_no_token must be a bool, got {allow_no_token!r}")
        self.allow_no_token = allow_no_token
        if max_body_bytes is None:
            raw = os.environ.get(MAX_BODY_ENV, "")
            try:
                max_body_bytes = int(raw) if raw else DEFAULT_MAX_BODY_BYTES
            except ValueError:
                raise ValueError(f"{MAX_BODY_ENV} must be a number of bytes, got {raw!r}") from None
        if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
        self.max_body_bytes = max_body_bytes
        self.current: str | None = None
        """The transport this API server process last initialized successfully."""
        self.active = False
        """An update this API server process started (2xx start) has not finished."""
        self.partly_applied: str | None = None
        """Why a failed sync left the engine's weights partly applied (``/resume`` refused), or None."""
        self._tracker = UpdateTracker()

    def _server_backend(self, scope: Scope) -> str | None:
        if self.backend is not None:
            return self.backend
        args = getattr(getattr(scope.get("app"), "state", None), "args", None)
        return _backend_of(getattr(args, "weight_transfer_config", None))

    def _multi_server(self, scope: Scope) -> bool:
        args = getattr(getattr(scope.get("app"), "state", None), "args", None)
        return int(getattr(args, "api_server_count", 1) or 1) > 1

    def _refusal(self, scope: Scope, path: str) -> tuple[int, str, str] | None:
        """Status, error type and message for a request refused before its body is read."""
        headers = dict(scope.get("headers") or [])
        if self.token is None and not self.allow_no_token and (bound := _public_bind(scope)) is not None:
            return 403, "ForbiddenError", (f"{path} is refused: this server listens on {bound}, not on loopback, "
                                           "and no "
                                           f"weight-transfer token is set: set {TOKEN_ENV} on the server (and pass "
                                           f"token= to the client), or {ALLOW_NO_TOKEN_ENV}=1 when the network in "
                                           "front of it is trusted")
        if self.token is not None and path in TOKEN_ROUTES:
            given = headers.get(TOKEN_HEADER.lower().encode(), b"")
            if not hmac.compare_digest(given, self.token):
                return 401, "UnauthorizedError", (f"{path} needs the weight-transfer token: send it in the "
                                                  f"{TOKEN_HEADER} header ({'wrong token' if given else 'none sent'})")
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            length = 0
        if path in ORDERED and length > self.max_body_bytes:
            return 413, "PayloadTooLargeError", (f"the request body has {length} bytes, more than the limit "
                                                 f"max_body_bytes={self.max_body_bytes} ({MAX_BODY_ENV})")
        return None

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if scope.get("type") != "http" or path not in TOKEN_ROUTES:
            await self.app(scope, receive, send)
            return
        if (refused := self._refusal(scope, path)) is not None:
            status, kind, text = refused
            await _respond(send, status, _error_body(text, status, kind))
            return
        if path == "/resume" and self.partly_applied is not None:
            text = partly_applied_message("this server", self.partly_applied)
            await _respond(send, 409, _error_body(text, 409, "ConflictError"))
            return
        if scope.get("method") != "POST" or path not in ORDERED:
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                text = f"the request body has more than the limit max_body_bytes={self.max_body_bytes} bytes " \
                       f"({MAX_BODY_ENV})"
                await _respond(send, 413, _error_body(text, 413, "PayloadTooLargeError"))
                return
            more = message.get("more_body", False)
        body = b"".join(chunks)
        multi = self._multi_server(scope)
        if path == "/init_weight_transfer_engine" and self.active and not multi:
            text = ("init_weight_transfer_engine refused: a weight update is active on this server (started, not "
                    "finished); an init would replace its trainer mid-update. Call /finish_weight_update first")
            await _respond(send, 409, _error_body(text, 409, "ConflictError"))
            return
        try:  # off the event loop: the server's other requests go on meanwhile
            named, field = await asyncio.to_thread(inspect_request, path, body, self._server_backend(scope),
                                                   None if multi else self.current)
        except RequestError as e:
            await _respond(send, 400, _error_body(str(e), 400, "BadRequestError", e.param))
            return
        if path == "/update_weights" and (partial := self._tracker.update(field)):
            self.partly_applied = partial  # the abort reaches the workers: what they applied stays
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            status = await _forward_mapping_conflicts(self.app, scope, replay, send)
        except BaseException:
            self._track(path, 500)  # raised through the route: Starlette answers 500
            raise
        self._track(path, status)
        if named is not None and 200 <= status < 300:
            self.current = named
            self._tracker.init(field)

    def _track(self, path: str, status: int) -> None:
        """Follow vLLM's worker: a 2xx start opens an update; a finish (2xx, or 409: none was open), or
        an update that failed with 5xx (vLLM's worker leaves the update then), closes it."""
        ok = 200 <= status < 300
        if path in ("/start_weight_update", "/start_draft_weight_update") and ok:
            self.active = True
            self._tracker.start()
        elif (path == "/finish_weight_update" and (ok or status == 409)) or (
                path == "/update_weights" and status >= 500):
            self.active = False
        if path == "/finish_weight_update" and ok and self._tracker.landed():
            self.partly_applied = None  # a full sync landed


def _public_bind(scope: Scope) -> str | None:
    """The address this server listens on when it is not loopback (None: loopback or a Unix socket).
    vLLM's ``--host`` (``app.state.args``; unset: every interface), else the address the request came in on."""
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    if args is not None:
        if getattr(args, "uds", None):
            return None
        host = getattr(args, "host", None) or "0.0.0.0"
    else:  # (not vllm serve: a server socket's local address is an IP; a test client's name is no address)
        server = scope.get("server")
        host = str(server[0]) if server else "localhost"
        if not _is_ip(host):
            return None
    if host == "localhost":
        return None
    return None if _is_ip(host) and ipaddress.ip_address(host.strip("[]")).is_loopback else host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


async def _respond(send: Callable[[Message], Awaitable[None]], status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _refused(send: Callable[[Message], Awaitable[None]], text: str) -> int:
    """Answer a worker's refusal: 403 for a call its trainer session did not announce, else 409 (out of
    order). Returns the status sent."""
    status, kind = (403, "ForbiddenError") if FENCED in text else (409, "ConflictError")
    await _respond(send, status, _error_body(text, status, kind))
    return status


async def _forward_mapping_conflicts(app: ASGIApp, scope: Scope, receive: Callable[[], Awaitable[Message]],
                                     send: Callable[[Message], Awaitable[None]]) -> int:
    """Run ``app``; a 5xx or an exception whose text is an out-of-order refusal goes out as 409, a
    worker's refusal of a call its trainer session did not announce as 403. Returns the status sent."""
    start: Message | None = None
    held: list[bytes] = []
    sent = 0

    async def watch(message: Message) -> None:
        nonlocal start, sent
        if message["type"] == "http.response.start":
            if message["status"] >= 500:
                start = message  # hold it until the body says what failed
                return
            sent = message["status"]
            await send(message)
            return
        if start is None or message["type"] != "http.response.body":
            await send(message)
            return
        held.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(held)
        text = body.decode(errors="replace")
        if any(s in text for s in (*OUT_OF_ORDER, FENCED)):
            try:
                text = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            inner = _WORKER_ERROR.search(text)
            sent = await _refused(send, inner.group(1) if inner else text)
        else:
            sent = start["status"]
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})

    try:
        await app(scope, receive, watch)
    except Exception as e:  # vLLM leaves raw errors to Starlette's outermost handler, outside this middleware
        text = str(e)
        if sent or start is not None or not any(s in text for s in (*OUT_OF_ORDER, FENCED)):
            raise
        inner = _WORKER_ERROR.search(text)
        return await _refused(send, inner.group(1) if inner else text)
    return sent
