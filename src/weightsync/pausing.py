"""Pausing by default: a sync starts only while every engine's generation is paused, and an engine
whose weights a failed sync left partly applied stays paused until a full sync lands.

* Before a sync moves anything, trainer rank 0 asks its client whether every engine's generation is
  paused (:func:`check_paused`, from ``TrainerEngine``'s preflight): ``client.generation_paused()``,
  one answer per engine (vLLM's scheduler state: ``AsyncLLM.is_paused``, ``GET /is_paused``, the
  engine core's ``is_scheduler_paused`` for an ``LLM`` actor). An engine that serves, or a client that
  cannot say (no ``generation_paused``, or it raised ``RemoteCallError``: a dead engine), refuses the
  sync on every trainer rank (``Refused``, naming the engine and what to call; nothing moved).
  ``TrainerInitInfo.require_paused=False`` allows syncs while the engines serve.
* ``paused(client)`` pauses generation around a sync and resumes it after (not after a failure that
  left the weights partly applied); ``weightsync.clients`` re-exports it. An engine that does not
  answer the pause (``RemoteCallError``) does not stop the body: the sync's preflight then refuses on
  every trainer rank, naming it, rather than rank 0 alone raising while the others wait in
  ``send_weights`` until ``timeout_s``.
* The calls a client makes say when an engine's weights are partly applied: the trainer aborts an
  update it started (``update_info.abort``: a failed or abandoned sync) and, without
  ``rollback=True``, the workers keep what they applied (``SyncFailed.restored`` False). From then
  until the finish of an update that was not aborted (a full sync landed), the engine refuses to
  resume generation (:class:`WeightsPartlyApplied`). The state lives with the engine, so every client
  of it sees it: on the ``LLM`` actor (``RayVLLMWeightSyncClient``), in the ``vllm serve`` middleware
  (``integrations.vllm_http``: ``POST /resume`` answers 409), in the harness's receiver processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from .errors import Refused, RemoteCallError

__all__ = ["check_paused", "not_paused", "preflight_error", "WeightsPartlyApplied", "UpdateTracker",
           "partly_applied_message", "REFUSED", "PAUSE_MODES", "paused"]

PAUSE_MODES = ("abort", "wait", "keep")
"""How vLLM treats in-flight requests while paused for a sync:
``abort`` drops them now (fastest; the caller re-submits); ``wait`` lets them finish first (no lost
work, the sync waits for the longest request); ``keep`` freezes them in the queue and resumes them
afterwards (their KV caches were computed with the old weights)."""


def _check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")


REFUSED = "weight sync refused: "
"""How a refused unpaused sync's message starts (every trainer rank raises it as ``Refused``)."""
_HOW = ("call client.pause_generation() before send_weights and client.resume_generation() after it, or sync "
        "inside weightsync.clients.paused(client); TrainerInitInfo.require_paused=False allows syncs while the "
        "engines serve (requests may then run on half-written weights)")


class WeightsPartlyApplied(RuntimeError):
    """``resume_generation`` refused: a failed sync left the engine's weights partly applied
    (``rollback=False``); generation stays paused until a full sync lands."""


def check_paused(engine: Any) -> None:
    """On trainer rank 0 with ``require_paused`` (the default): ``Refused`` unless every engine of
    ``engine.client`` reports its generation paused. Other ranks return at once (they learn the
    refusal from rank 0's preflight). Moves nothing."""
    info = engine.init_info
    if info.rank != 0 or not getattr(info, "require_paused", True):
        return
    client = engine.client
    ask = getattr(client, "generation_paused", None)
    if ask is None:
        raise Refused(f"{REFUSED}the client {type(client).__name__} cannot report whether the engines' generation is "
                      f"paused (it has no generation_paused()): give it one, or {_HOW}")
    try:
        states = ask()
    except RemoteCallError as e:
        raise Refused(f"{REFUSED}could not ask whether every engine's generation is paused: {e}") from None
    if (refused := not_paused(states)) is not None:
        raise refused


def not_paused(states: dict[str, bool]) -> Refused | None:
    """The refusal of a sync while the engines of ``states`` (engine label -> paused, every engine the
    trainer syncs) serve, naming each one that does and counting them all; None when all are paused."""
    running = [name for name, paused in states.items() if not paused]
    if not running:
        return None
    return Refused(f"{REFUSED}{', '.join(running)}: generation is not paused ({len(running)} of {len(states)} "
                   f"engine(s)); {_HOW}")


def preflight_error(message: str) -> ValueError:
    """What every trainer rank raises for a preflight error (``message``): ``Refused`` for a refused
    unpaused sync, else ``ValueError``."""
    return Refused(message) if message.startswith(REFUSED) else ValueError(message)


def partly_applied_message(where: str, reason: str) -> str:
    return (f"resume_generation refused: {where}: a failed weight sync left its weights partly applied "
            f"(rollback=False; {reason}); generation stays paused until a full sync lands: re-initialize "
            "(trainer_init on every trainer rank) and sync again")


class UpdateTracker:
    """What a client's own calls say about its engines' weights (see the module docstring): feed it
    every init, start, update and finish the client sends."""

    def __init__(self) -> None:
        self.rollback = False
        self.aborted = False

    def init(self, init_info: Any) -> None:
        self.rollback = isinstance(init_info, dict) and init_info.get("rollback") is True

    def start(self) -> None:
        self.aborted = False

    def update(self, update_info: Any) -> str | None:
        """The reason the weights are now partly applied (an abort without rollback), else None."""
        infos = update_info if isinstance(update_info, list) else [update_info]
        reason = next((i["abort"] for i in infos if isinstance(i, dict) and i.get("abort") is not None), None)
        if reason is None:
            return None
        self.aborted = True
        return None if self.rollback else f"the trainer aborted the update: {reason}"

    def landed(self) -> bool:
        """At a finish: whether it completes a full sync (an update that was not aborted)."""
        return not self.aborted


@contextmanager
def paused(client: Any, mode: str = "abort", clear_cache: bool = True) -> Iterator[None]:
    """Pause generation for the body (a sync) and resume afterwards::

        with paused(client, mode="wait"):
            engine.send_weights(weight_version=f"step{step}")

    When the body raises a ``SyncFailed`` whose engines may hold partly updated weights
    (``restored`` False: the default ``rollback=False`` and data had moved), generation stays
    paused: re-initialize, sync again (inside ``paused`` again, which resumes on success), or call
    ``client.resume_generation()`` yourself once a full sync landed (until then our clients refuse it:
    ``WeightsPartlyApplied``). A ``SyncFailed`` with ``stuck`` (an engine did not answer a call
    within ``timeout_s``) leaves generation paused too: resuming would wait on that engine; resume once
    it answers. Any other failure resumes generation, unless an earlier failure's weights are still
    partly applied. A sync outside ``paused`` is refused (``Refused``) unless the
    init info says ``require_paused=False``."""
    with suppress(RemoteCallError):  # an engine that does not answer: the sync's preflight refuses, naming it
        client.pause_generation(mode=mode, clear_cache=clear_cache)
    try:
        yield
    except BaseException as e:
        if getattr(e, "restored", True) and not getattr(e, "stuck", False):
            # WeightsPartlyApplied: an earlier failure's weights are still partly applied: stay paused;
            # RemoteCallError: an engine that does not answer; the body's own error is the one to raise
            with suppress(WeightsPartlyApplied, RemoteCallError):
                client.resume_generation()
        raise
    client.resume_generation()
