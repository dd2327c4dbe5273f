"""Limits on what a weight-sync HTTP request may carry, checked in the API server before anything
reaches a worker (``weightsync.integrations.vllm_http``): the JSON nesting depth, and the range of
every number (ports, ranks and counts, byte sizes and offsets, IPC handle fields), so that no
out-of-range value reaches torch (``_new_shared_cuda``), a socket or an allocation.

Pure: no vLLM, FastAPI or torch import.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

__all__ = ["LimitError", "loads", "check_ranges", "MAX_DEPTH", "MAX_BYTES", "MAX_COUNT"]

MAX_DEPTH = 16
"""Deepest JSON nesting a request may have (weightsync's infos nest at most 6 deep)."""
MAX_BYTES = 1 << 50
"""Largest byte size or offset (1 PiB): anything larger names no real buffer."""
MAX_COUNT = 1 << 20
"""Largest rank, worker, engine, chunk or mesh count."""
MAX_DIM = 1 << 40
"""Largest tensor dimension."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_HANDLE_CHARS = 4096
"""Longest base64 text of a CUDA IPC handle, ref counter or event (they are 64-byte-ish blobs)."""
INT64 = (-(1 << 63), (1 << 63) - 1)

RANGES: dict[str, tuple[int, int]] = {
    "master_port": (0, 65535),
    **dict.fromkeys(("world_size", "num_trainer_ranks", "num_workers", "num_engines", "num_buffers",
                     "dst_mesh_dims"), (1, MAX_COUNT)),
    **dict.fromkeys(("rank", "engine_index", "chunk", "num_chunks", "trainer_rank", "worker_to_trainer",
                     "delta_workers", "via_loader_per_worker", "fallbacks_per_worker"), (0, MAX_COUNT)),
    **dict.fromkeys(("bucket_bytes", "staging_bytes", "size", "nbytes"), (1, MAX_BYTES)),
    **dict.fromkeys(("offset", "ref_counter_offset"), (0, MAX_BYTES)),
    **dict.fromkeys(("sync_id", "delta_base"), (0, INT64[1])),
    "shapes": (0, MAX_DIM),
}
"""Field name -> the inclusive range of the ints it holds (itself, or its list's or dict's values);
any other int must fit in int64."""
B64_FIELDS = ("handle", "ref_counter", "event")
"""String fields of a CUDA IPC handle: base64 of at most ``MAX_HANDLE_CHARS`` characters."""


class LimitError(ValueError):
    """A request outside the limits; ``param`` is the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _no_constant(name: str) -> Any:
    raise LimitError(f"the request body holds {name}, which is not a JSON number")


def loads(body: bytes) -> Any:
    """``json.loads`` refusing NaN/Infinity and nesting deeper than ``MAX_DEPTH`` (``LimitError``,
    never a ``RecursionError``); ``ValueError`` for text that is not JSON."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except RecursionError:  # the parser recursed ~1000 levels deep
        raise LimitError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    stack = [(data, 0)]
    while stack:  # the depth of what parsed, without recursion
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                raise LimitError(f"the request body nests deeper than {MAX_DEPTH} levels")
            stack.extend((item, depth + 1) for item in (v.values() if isinstance(v, dict) else v))
    return data


def _check_number(path: str, key: str, value: int | float) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise LimitError(f"{path} must be a finite number, got {value}", key)
    if key == "timeout_s":
        if not 0 < value <= MAX_TIMEOUT_S:
            raise LimitError(f"{path} must be in (0, {MAX_TIMEOUT_S:.0f}] seconds, got {value}", key)
        return
    if isinstance(value, int):
        lo, hi = RANGES.get(key, INT64)
        if not lo <= value <= hi:
            raise LimitError(f"{path} must be in [{lo}, {hi}], got {value}", key)


def _check_handle(path: str, fields: dict[str, Any]) -> None:
    for name in B64_FIELDS:
        text = fields.get(name)
        if text is None:
            continue
        if not isinstance(text, str) or len(text) > MAX_HANDLE_CHARS:
            raise LimitError(f"{path}.{name} must be base64 text of at most {MAX_HANDLE_CHARS} characters, "
                             f"got {type(text).__name__} of {len(text) if isinstance(text, str) else '?'}", name)
        try:
            base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise LimitError(f"{path}.{name} is not base64: {text[:40]!r}", name) from None
    for name in ("size", "offset", "ref_counter_offset", "nbytes"):
        if name in fields and (not isinstance(fields[name], int) or isinstance(fields[name], bool)):
            raise LimitError(f"{path}.{name} must be an int, got {fields[name]!r:.40}", name)
    if fields.get("kind") == "cuda" and not all(isinstance(fields.get(n), int) for n in ("size", "offset")):
        raise LimitError(f"{path}: a CUDA IPC handle needs int size and offset", "size")


def check_ranges(value: Any, what: str) -> None:
    """Raise ``LimitError`` naming the field for any number in ``value`` (an init or update info as
    JSON) outside its range, a float that is not finite, ``timeout_s`` not in (0, one week], or an
    IPC handle whose fields are not what ``_new_shared_cuda`` / a shm mapping expects."""
    stack: list[tuple[str, str, Any, bool]] = [(what, "", value, False)]
    while stack:
        path, key, v, in_handle = stack.pop()
        if isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        if isinstance(v, (int, float)):
            _check_number(path, key, v)
        elif isinstance(v, dict):
            if in_handle:
                _check_handle(path, v)
            for k, item in v.items():
                if key == "handles" and not in_handle and not (isinstance(k, str) and k.isdigit()
                                                               and int(k) < MAX_COUNT):
                    raise LimitError(f"{path} keys must be worker ranks in [0, {MAX_COUNT}), got {k!r:.40}", key)
                if key == "handle" and not in_handle:  # {device key: handle fields}
                    stack.append((f"{path}.{k}", "", item, True))
                elif not in_handle and key in (*RANGES, "handles", "checksums"):  # a dict of this field's values
                    stack.append((f"{path}.{k}", "" if key == "handles" else key, item, False))
                else:
                    stack.append((f"{path}.{k}", k, item, False))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", key, item, False) for i, item in enumerate(v))
