"""The errors a weightsync user may catch, in one place (all exported from ``weightsync``).

- :class:`SyncFailed`: a sync failed; every trainer rank raises it with the same first failure.
- :class:`PoisonedError`: an engine saw a failed sync and refuses syncs until re-initialized.
- :class:`DataPlaneError`: a peer failed, or a data-plane operation failed or timed out.
- :class:`SyncAborted`: the trainer aborted a sync in-band (a ``DataPlaneError``).
- :class:`RemoteCallError`: an inference-side client call failed (carries the remote error text).
- :class:`EngineDead`: a ``RemoteCallError``: the vLLM engine core behind a live actor or server died.
- :class:`Refused`: a ``ValueError``: the engine refused the trainer's init (a model or deployment
  mismatch, an info for another transport) before any data moved; carries the worker's message.

Bad input (a model mismatch, a wrongly typed info field) is a ``ValueError`` naming the parameter.
"""

from __future__ import annotations

__all__ = ["SyncFailed", "PoisonedError", "DataPlaneError", "SyncAborted", "RemoteCallError", "EngineDead", "Refused",
           "refusal"]


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
    """The vLLM engine core behind an inference actor died (vLLM's ``EngineDeadError``) while the actor
    lives: no call will succeed until the engine is restarted; then ``trainer_init`` again."""


class Refused(ValueError):
    """The inference side refused the trainer's init info or metadata before any data moved (a model
    mismatch naming the parameter and both shapes, a deployment or transport mismatch). The message
    is the worker's (``worker N: ValueError: ...``); the engine's weights and version are unchanged,
    and a corrected ``trainer_init`` may follow at once."""


def refusal(failure: str | None) -> Refused | None:
    """``Refused`` when a failure reported on the store (``"<party>: <Type>: <message>"``) is a
    worker's ``ValueError`` (its refusal of bad input), else None."""
    if failure is None or not failure.startswith("worker "):
        return None
    party, _, rest = failure.partition(": ")
    return Refused(failure) if rest.startswith("ValueError: ") and party[7:].isdigit() else None
