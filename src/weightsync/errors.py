"""The errors a weightsync user may catch, in one place (all exported from ``weightsync``).

- :class:`SyncFailed`: a sync failed; every trainer rank raises it with the same first failure.
- :class:`PoisonedError`: an engine saw a failed sync and refuses syncs until re-initialized.
- :class:`DataPlaneError`: a peer failed, or a data-plane operation failed or timed out.
- :class:`SyncAborted`: the trainer aborted a sync in-band (a ``DataPlaneError``).
- :class:`RemoteCallError`: an inference-side client call failed (carries the remote error text).

Bad input (a model mismatch, a wrongly typed info field) is a ``ValueError`` naming the parameter.
"""

from __future__ import annotations

__all__ = ["SyncFailed", "PoisonedError", "DataPlaneError", "SyncAborted", "RemoteCallError"]


class SyncFailed(RuntimeError):
    """A sync failed. Every trainer rank raises it with the same (first) failure; every engine
    refuses syncs until ``trainer_init`` runs again. ``restored``: the engines' weights are those of
    the last complete sync (the failure came before the update started, or ``rollback=True``);
    False: they may be partly updated until a full sync lands (``clients.paused`` keeps generation
    paused then)."""

    def __init__(self, message: str, *, restored: bool = True) -> None:
        super().__init__(message)
        self.restored = restored


class PoisonedError(RuntimeError):
    """The engine saw a failed sync and refuses updates until ``init_transfer_engine`` runs again."""


class DataPlaneError(RuntimeError):
    """A peer failed, or a data-plane operation failed or timed out."""


class SyncAborted(DataPlaneError):
    """The trainer aborted the sync in-band; the data plane itself is intact."""


class RemoteCallError(RuntimeError):
    """An inference-side call failed; the message carries the remote error text."""
