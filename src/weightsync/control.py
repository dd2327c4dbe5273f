"""The control contract between trainer ranks and workers: the store keys of a sync.

Every key a transport or worker reads or writes on the group's store is spelled here.
"""

from __future__ import annotations

__all__ = ["held_key"]


def held_key(sync_id: int, worker: int) -> str:
    """The store key where ``worker`` says it holds sync ``sync_id`` complete (None: no longer)."""
    return f"sync{sync_id}/held/{worker}"
