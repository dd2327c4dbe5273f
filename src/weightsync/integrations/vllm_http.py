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

Servers whose backend is not weightsync's pass every body through unchanged (only the 409 mapping
applies). Pure ASGI: no vLLM, FastAPI or Starlette import (``import weightsync`` stays free of them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..infos import parse_info
from ..registry import TRANSPORTS, transport

__all__ = ["WeightSyncRequestValidation", "validate_request", "RequestError", "OUT_OF_ORDER"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

ANY = "weightsync"
"""vLLM's worker backend that serves whichever weightsync transport an init info names."""
ROUTES = {"/init_weight_transfer_engine": "init_info", "/update_weights": "update_info"}
"""Route -> the one body field it takes (validated)."""
ORDERED = {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
           "/shutdown_weight_transfer_engine"}
"""Routes whose out-of-order refusals are answered 409."""
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
    if path not in ROUTES or not (backend == ANY or backend in TRANSPORTS):
        return None
    key = ROUTES[path]
    try:
        data = json.loads(body) if body.strip() else None
    except ValueError as e:
        raise RequestError(f"the request body is not JSON: {e}") from None
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
        return name
    infos = value if isinstance(value, list) else [value]
    if not infos or not all(isinstance(i, dict) for i in infos):
        raise RequestError("update_info must be a JSON object or a non-empty list of them (one per worker)", key)
    names = [current] if current else [backend] if backend != ANY else sorted(TRANSPORTS)
    classes = list(dict.fromkeys(transport(n).worker_engine.update_info_cls for n in names))
    for i, info in enumerate(infos):
        errors = []
        for cls in classes:
            try:
                _parse(cls, info, "update_info" if len(infos) == 1 else f"update_info[{i}]")
                break
            except RequestError as e:
                errors.append(e)
        else:
            raise errors[0]
    return None


def _error_body(message: str, code: int, kind: str, param: str | None = None) -> bytes:
    """vLLM's ``ErrorResponse`` shape."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


class WeightSyncRequestValidation:
    """The ASGI middleware (``vllm serve --middleware weightsync.integrations.vllm_http.WeightSyncRequestValidation``).

    ``backend`` defaults to the server's own (``app.state.args.weight_transfer_config``, read per request)."""

    def __init__(self, app: ASGIApp, backend: str | None = None) -> None:
        self.app = app
        self.backend = backend
        self.current: str | None = None
        """The transport this API server process last initialized successfully."""

    def _server_backend(self, scope: Scope) -> str | None:
        if self.backend is not None:
            return self.backend
        args = getattr(getattr(scope.get("app"), "state", None), "args", None)
        return _backend_of(getattr(args, "weight_transfer_config", None))

    def _multi_server(self, scope: Scope) -> bool:
        args = getattr(getattr(scope.get("app"), "state", None), "args", None)
        return int(getattr(args, "api_server_count", 1) or 1) > 1

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if scope.get("type") != "http" or scope.get("method") != "POST" or path not in ORDERED:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        current = None if self._multi_server(scope) else self.current
        try:
            named = validate_request(path, body, self._server_backend(scope), current)
        except RequestError as e:
            await _respond(send, 400, _error_body(str(e), 400, "BadRequestError", e.param))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        status = await _forward_mapping_conflicts(self.app, scope, replay, send)
        if named is not None and 200 <= status < 300:
            self.current = named


async def _respond(send: Callable[[Message], Awaitable[None]], status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _forward_mapping_conflicts(app: ASGIApp, scope: Scope, receive: Callable[[], Awaitable[Message]],
                                     send: Callable[[Message], Awaitable[None]]) -> int:
    """Run ``app``; a 5xx or an exception whose text is an out-of-order refusal goes out as 409.
    Returns the status sent."""
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
        if any(s in text for s in OUT_OF_ORDER):
            try:
                text = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            inner = _WORKER_ERROR.search(text)
            sent = 409
            await _respond(send, 409, _error_body(inner.group(1) if inner else text, 409, "ConflictError"))
        else:
            sent = start["status"]
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})

    try:
        await app(scope, receive, watch)
    except Exception as e:  # vLLM leaves raw errors to Starlette's outermost handler, outside this middleware
        text = str(e)
        if sent or start is not None or not any(s in text for s in OUT_OF_ORDER):
            raise
        inner = _WORKER_ERROR.search(text)
        await _respond(send, 409, _error_body(inner.group(1) if inner else text, 409, "ConflictError"))
        return 409
    return sent
