"""The errors a weightsync user may catch, in one place (all exported from ``weightsync``).

- :class:`SyncFailed`: a sync failed; every trainer rank raises it with the same first failure.
- :class:`PoisonedError`: an engine saw a failed sync and refuses syncs until re-initialized.
- :class:`DataPlaneError`: a peer failed, or a data-plane operation failed or timed out.
- :class:`SyncAborted`: the trainer aborted a sync in-band (a ``DataPlaneError``).
- :class:`RemoteCallError`: an inference-side client call failed (carries the remote error text).
- :class:`EngineDead`: a ``RemoteCallError``: the vLLM engine (its core, or the actor holding it) died or
  never started; the message names the cause.
- :class:`Refused`: a ``ValueError``: the engine refused the trainer's init (a model or deployment
  mismatch, an info for another transport) before any data moved; carries the worker's message.
- :class:`Unauthorized`: a ``Refused`` (and a ``RemoteCallError``): a ``vllm serve`` front answered
  HTTP 401, the client sent no weight-transfer token or a wrong one.

Bad input (a model mismatch, a wrongly typed info field) is a ``ValueError`` naming the parameter.
"""

from __future__ import annotations

__all__ = ["SyncFailed", "PoisonedError", "DataPlaneError", "SyncAborted", "RemoteCallError", "EngineDead", "Refused",
           "Unauthorized", "refusal", "client_failure"]


class SyncFailed(RuntimeError):
    """A sync failed. Every trainer rank raises it with the same (first) failure; every engine
    refuses syncs until ``trainer_init`` runs again. ``restored``: the engines' weights are those of
    the last complete sync (the failure came before the update started, or ``rollback=True``);
    False: they may be partly updated until a full sync lands (``clients.paused`` keeps generation
    paused then). ``stuck``: on trainer rank 0, a client call to the engines had not returned when the
    sync gave up (an engine does not answer): ``clients.paused`` then leaves generation paused rather
    than wait on that engine to resume it."""

    def __init__(self, message: str, *, restored: bool = True, stuck: bool = False) -> None:
        super().__init__(message)
        self.restored = restored
        self.stuck = stuck


class PoisonedError(RuntimeError):
    """The engine saw a failed sync and refuses updates until ``init_transfer_engine`` runs again."""


class DataPlaneError(RuntimeError):
    """A peer failed, or a data-plane operation failed or timed out."""


class SyncAborted(DataPlaneError):
    """The trainer aborted the sync in-band; the data plane itself is intact."""


class RemoteCallError(RuntimeError):
    """An inference-side call failed; the message carries the remote error text."""


class EngineDead(RemoteCallError):
    """The vLLM engine behind an inference actor is dead: its engine core died (vLLM's
    ``EngineDeadError``) while the actor lives, or the actor itself died or never started (its
    ``LLM(...)`` raised: the message names that error). No call will succeed until the engine is
    (re)started; then ``trainer_init`` again."""


class Refused(ValueError):
    """The inference side refused the trainer's init info or metadata before any data moved (a model
    mismatch naming the parameter and both shapes, a deployment or transport mismatch). The message
    is the worker's (``worker N: ValueError: ...``); the engine's weights and version are unchanged,
    and a corrected ``trainer_init`` may follow at once."""


class Unauthorized(Refused, RemoteCallError):
    """A ``vllm serve`` front refused a call with HTTP 401: the server requires its weight-transfer
    token (``WEIGHTSYNC_HTTP_TOKEN`` on the server) and the client sent none or another one (pass
    ``token=`` to ``HTTPVLLMWeightSyncClient``). A ``Refused`` (nothing moved) and a ``RemoteCallError``."""


_CLIENT_ERRORS: dict[str, type[RemoteCallError]] = {"Unauthorized": Unauthorized, "EngineDead": EngineDead}
_CALL_FAILED = "the client's "


def client_failure(failure: str | None) -> RemoteCallError | None:
    """The client's own error when a failure reported on the store is trainer rank 0's client call
    failing with ``Unauthorized`` or ``EngineDead`` (``"...: the client's <call> failed: <Type>: <message>"``),
    so that every trainer rank raises that type; else None."""
    if failure is None or (at := failure.find(_CALL_FAILED)) < 0:
        return None
    _, sep, rest = failure[at:].partition(" failed: ")
    kind, _, message = rest.partition(": ")
    return _CLIENT_ERRORS[kind](message) if sep and kind in _CLIENT_ERRORS else None


def refusal(failure: str | None) -> Refused | None:
    """``Refused`` when a failure reported on the store (``"<party>: <Type>: <message>"``) is a
    worker's ``ValueError`` (its refusal of bad input), or a trainer rank's ``Refused`` that carries
    one (the rank that read the refusal first reported it), else None."""
    if failure is None:
        return None
    party, _, rest = failure.partition(": ")
    if party.startswith("trainer rank ") and rest.startswith("Refused: "):
        return Refused(rest.removeprefix("Refused: "))
    if party.startswith("worker ") and party[7:].isdigit() and rest.startswith("ValueError: "):
        return Refused(failure)
    return None
