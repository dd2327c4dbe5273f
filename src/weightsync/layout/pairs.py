"""One rank's side of a transfer plan, per peer, with no object per item until it is used.

:meth:`TransferPlan.items_for_src` / :meth:`~TransferPlan.items_for_dst` list a rank's items as
objects: at model scale (a 1T-parameter MoE exported as per-expert 2-D tensors) that is millions
of objects and hundreds of MB per rank. :class:`PairItems` keeps what they are made from instead:
for each peer, the signatures whose tensors it exchanges with this rank and the planned copies of
one tensor of that signature (shared by every tensor that has it). The items between one
(trainer, worker) pair come out of :meth:`PairItems.items` in *pair order*: signatures in plan
order, then their tensors in sources order, then the copies of each in plan order. Both ends of a
pair see the same sequence (the schedule cuts both into the same messages).

Pure: no torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from weightsync.layout.plan_compact import Compact
from weightsync.layout.records import TransferItem, new_item

__all__ = ["PairItems"]


class PairItems:
    """What one rank sends to (``sender``) or receives from each peer; build it with
    :meth:`TransferPlan.pairs`. Holds O(peers x signatures) entries, not one per item."""

    def __init__(self, compact: Compact, members: Sequence[tuple[int, ...]], rank: int, *, sender: bool) -> None:
        self._c, self._members, self.rank, self.sender = compact, members, rank, sender
        runs: dict[int, list[tuple[int, tuple[Any, ...]]]] = {}
        wc = compact.worker_class
        for sig, tpl in enumerate(compact.templates):
            protos = tpl.protos_for_src(rank, wc) if sender else tpl.protos_for_dst(rank, wc)
            by_peer: dict[int, list[Any]] = {}
            for p in protos:  # SendProto.dst / RecvProto.src first: the peer
                by_peer.setdefault(p[0], []).append(p)
            for peer, ps in by_peer.items():
                runs.setdefault(peer, []).append((sig, tuple(ps)))
        self._runs = {peer: tuple(runs[peer]) for peer in sorted(runs)}

    @property
    def peers(self) -> tuple[int, ...]:
        """The peers this rank exchanges anything with, ascending."""
        return tuple(self._runs)

    def count(self, peer: int | None = None) -> int:
        """Number of items with ``peer`` (all peers when None)."""
        peers = self._runs if peer is None else (peer,)
        return sum(len(self._members[sig]) * len(ps) for p in peers for sig, ps in self._runs.get(p, ()))

    def nbytes(self, itemsize_of: Callable[[str], int]) -> int:
        """Bytes of all items (``itemsize_of`` maps a dtype name to bytes per element)."""
        dtypes = self._c.sig_dtype
        return sum(len(self._members[sig]) * sum(p.region.numel for p in ps) * itemsize_of(dtypes[sig])
                   for runs in self._runs.values() for sig, ps in runs)

    def items(self, peer: int) -> Iterator[TransferItem]:
        """The items with ``peer``, in pair order (made as they are consumed)."""
        names, params = self._c.names, self._c.params
        src, dst = (self.rank, peer) if self.sender else (peer, self.rank)
        for sig, protos in self._runs.get(peer, ()):
            for t in self._members[sig]:
                name, pn = names[t], params[t]
                for p in protos:
                    yield new_item(src, dst, name, p.region, p.src_offsets, pn[p.piece], p.param_offsets)
