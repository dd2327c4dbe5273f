"""Compact form of a transfer plan: tensors with one layout are planned once.

:func:`compact_plan` is the engine behind :func:`weightsync.layout.plan.build_plan`. At model
scale (tens of thousands of tensors, hundreds of ranks) an item list is hundreds of millions
long, so nothing here is per item: destination lists that are equal form one *worker class*,
tensors whose shape, dtype, source regions and per-class destination regions are equal form
one *signature*, and each signature is planned once into a
:class:`~weightsync.layout.plan_template.Template` that per-rank item lists are instantiated
from on demand.

Pure: no torch import. Not part of the public API.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, le, lt
from typing import Any

from weightsync.layout.plan_template import SourceLayout, Template, plan_template, source_layout
from weightsync.layout.regions import Region

__all__ = ["Compact", "compact_plan"]

_DIGEST_VERSION = "weightsync.layout.plan/1"


@dataclass
class Compact:
    """Everything a :class:`TransferPlan` answers from; built by :func:`compact_plan`."""

    # trainer (source) and worker (destination) rank counts
    num_src: int
    num_dst: int
    # worker_class[w]: class of worker w; workers of one class want identical pieces
    worker_class: tuple[int, ...]
    # per tensor, in sources order: name, dtype, signature index, param name per flat piece
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    tensor_sig: tuple[int, ...]
    params: tuple[tuple[str, ...], ...]
    # per signature: template, tensor count, element count each worker asks for per tensor
    templates: tuple[Template, ...]
    sig_tensors: tuple[int, ...]
    sig_dst_numel: tuple[tuple[int, ...], ...]
    # per signature: the dtype, and sha256 hex of the canonical encoding of the whole plan
    sig_dtype: tuple[str, ...]
    digest: str


class _Interner:
    """Map values to small ints; ``by_id`` memoizes by identity (callers keep the objects alive)."""

    def __init__(self) -> None:
        self.by_id: dict[int, int] = {}
        self.by_value: dict[Any, int] = {}
        self.values: list[Any] = []

    def intern(self, value: Any) -> int:
        """Index of ``value`` (equal values get equal indices)."""
        idx = self.by_value.get(value)
        if idx is None:
            idx = self.by_value[value] = len(self.values)
            self.values.append(value)
        self.by_id[id(value)] = idx
        return idx

    def ids_by_identity(self, objs: list[Any]) -> list[int]:
        """Indices of ``objs``, interning each distinct object once (C-level passes otherwise)."""
        by_id = self.by_id
        for key, obj in dict(zip(map(id, objs), objs)).items():
            if key not in by_id:
                self.intern(obj)
        return list(map(by_id.__getitem__, map(id, objs)))

    def ids_by_value(self, objs: list[Any]) -> list[int]:
        """Indices of ``objs``, hashing values (for cheap-to-hash values such as int tuples)."""
        by_value = self.by_value
        for obj in dict.fromkeys(objs):
            if obj not in by_value:
                self.intern(obj)
        return list(map(by_value.__getitem__, objs))


_NAME, _REGION, _OFFSETS, _PARAM = (attrgetter(a) for a in ("name", "region", "param_offsets", "param"))

# One worker's pieces, column-wise and stably ordered by tensor: tensor indices, region ids,
# param-offsets ids, param names.
_Entries = tuple[list[int], list[int], list[int], list[str]]


def _worker_entries(
    w: int, pieces: Sequence[Any], name_index: dict[str, int], regions: _Interner, offsets: _Interner
) -> _Entries:
    """Compact one worker's destination list (C-level passes: this runs on ~10^6 pieces)."""
    from weightsync.layout.plan import DestPiece

    pieces = list(pieces)
    if not set(map(type, pieces)) <= {DestPiece}:
        bad = next((p for p in pieces if not isinstance(p, DestPiece)), None)
        if bad is not None:
            raise TypeError(f"destinations[{w}] must hold DestPiece objects, got {bad!r}")
    names = list(map(_NAME, pieces))
    ts: list[Any] = list(map(name_index.get, names))
    if None in ts:
        p = pieces[ts.index(None)]
        raise ValueError(f"destination piece on worker {w} names unknown tensor {p.name!r} (param {p.param!r})")
    regs = list(map(_REGION, pieces))
    rids = regions.ids_by_identity(regs)
    offs = list(map(_OFFSETS, pieces))
    oids = offsets.ids_by_value(offs)
    params: list[Any] = list(map(_PARAM, pieces))
    if not all(map(le, ts, ts[1:])):
        order = sorted(range(len(ts)), key=ts.__getitem__)
        ts, rids, oids, params = ([col[j] for j in order] for col in (ts, rids, oids, params))
    return ts, rids, oids, params


def _flatten(n: int, classes: Sequence[_Entries]) -> tuple[list[tuple[int, ...]], list[tuple[str, ...]]]:
    """Per tensor: its pieces over all classes as ``(class, region id, offsets id, ...)`` and their params."""
    ts0 = classes[0][0] if classes else []
    if all(e[0] == ts0 for e in classes) and all(map(lt, ts0, ts0[1:])):
        # Common case: every worker takes each tensor at most once, in one order.
        cols: list[Any] = []
        for c, e in enumerate(classes):
            cols += (repeat(c), e[1], e[2])
        flats: Any = zip(*cols)
        pns: Any = zip(*(e[3] for e in classes))
        if ts0 == list(range(n)):
            return list(flats), list(pns)
        flat_of: list[tuple[int, ...]] = [()] * n
        pn_of: list[tuple[str, ...]] = [()] * n
        for t, fl, pn in zip(ts0, flats, pns):
            flat_of[t], pn_of[t] = fl, pn
        return flat_of, pn_of
    flat: list[list[int]] = [[] for _ in range(n)]
    pnames: list[list[str]] = [[] for _ in range(n)]
    for c, (ts, rids, oids, params) in enumerate(classes):
        for t, rid, oid, param in zip(ts, rids, oids, params):
            flat[t] += (c, rid, oid)
            pnames[t].append(param)
    return list(map(tuple, flat)), list(map(tuple, pnames))


def compact_plan(
    sources: Sequence[Any], destinations: Sequence[Sequence[Any]], itemsize_of: Callable[[str], int]
) -> Compact:
    """Group, validate and plan; see :func:`weightsync.layout.plan.build_plan` for the rules."""
    from weightsync.layout.plan import TensorSource

    sources = tuple(sources)  # keep every object alive: identities are memo keys below
    dests = tuple(destinations)
    name_index: dict[str, int] = {}
    layouts: list[SourceLayout] = []
    layout_by_id: dict[tuple[int, tuple[int, ...]], int] = {}
    layout_by_value: dict[tuple[Any, ...], int] = {}
    src_ids = []
    num_src = len(sources[0].regions) if sources else 0
    for i, s in enumerate(sources):
        if not isinstance(s, TensorSource):
            raise TypeError(f"sources[{i}] must be a TensorSource, got {s!r}")
        if name_index.setdefault(s.name, i) != i:
            raise ValueError(f"sources name tensor {s.name!r} twice (at {name_index[s.name]} and {i})")
        if len(s.regions) != num_src:
            raise ValueError(
                f"tensor {s.name!r} has {len(s.regions)} source regions, expected {num_src} "
                f"(one per trainer rank, as tensor {sources[0].name!r})"
            )
        key = (id(s.regions), s.shape)
        lid = layout_by_id.get(key)
        if lid is None:
            vkey = (s.shape, s.regions)
            lid = layout_by_value.get(vkey)
            if lid is None:
                lid = layout_by_value[vkey] = len(layouts)
                layouts.append(source_layout(s.name, s.shape, s.regions))
            layout_by_id[key] = lid
        src_ids.append(lid)

    regions, offsets = _Interner(), _Interner()
    class_of_list: dict[int, int] = {}
    class_by_key: dict[tuple[Any, ...], int] = {}
    classes: list[_Entries] = []
    worker_class = []
    for w, pieces in enumerate(dests):
        c = class_of_list.get(id(pieces))
        if c is None:
            entries = _worker_entries(w, pieces, name_index, regions, offsets)
            c = class_by_key.setdefault(tuple(tuple(col) for col in entries), len(classes))
            if c == len(classes):
                classes.append(entries)
            class_of_list[id(pieces)] = c
        worker_class.append(c)
    class_workers: list[list[int]] = [[] for _ in classes]
    for w, c in enumerate(worker_class):
        class_workers[c].append(w)
    flat, pnames = _flatten(len(sources), classes)

    sig_index: dict[tuple[Any, ...], int] = {}
    sig_keys: list[tuple[Any, ...]] = []
    sig_first: list[int] = []
    sig_count: list[int] = []
    tensor_sig = []
    for t, s in enumerate(sources):
        sig_key = (s.shape, s.dtype, src_ids[t], flat[t])
        sig = sig_index.setdefault(sig_key, len(sig_keys))
        if sig == len(sig_keys):
            sig_keys.append(sig_key)
            sig_first.append(t)
            sig_count.append(0)
        sig_count[sig] += 1
        tensor_sig.append(sig)
    del flat

    itemsizes: dict[str, int] = {}
    load = [0] * num_src
    overlap_cache: dict[tuple[int, Region], list[tuple[int, Region]]] = {}
    templates = []
    dst_numel = []
    for sig, (shape, dtype, lid, fl) in enumerate(sig_keys):
        name = sources[sig_first[sig]].name
        if dtype not in itemsizes:
            itemsizes[dtype] = itemsize_of(dtype)
        class_pieces: list[list[tuple[int, Region, tuple[int, ...]]]] = [[] for _ in classes]
        for f in range(0, len(fl), 3):
            class_pieces[fl[f]].append((f // 3, regions.values[fl[f + 1]], offsets.values[fl[f + 2]]))
        tpl = plan_template(
            name, shape, itemsizes[dtype], layouts[lid], class_pieces, class_workers, worker_class,
            sig_count[sig], load, overlap_cache,
        )
        templates.append(tpl)
        dst_numel.append(tuple(sum(r.numel for _, r, _ in class_pieces[c]) for c in worker_class))

    digest = _digest(num_src, worker_class, itemsizes, sources, sig_keys, layouts, regions, offsets,
                     tensor_sig, pnames, sig_first)
    return Compact(
        num_src=num_src,
        num_dst=len(dests),
        worker_class=tuple(worker_class),
        names=tuple(s.name for s in sources),
        dtypes=tuple(s.dtype for s in sources),
        tensor_sig=tuple(tensor_sig),
        params=tuple(pnames),
        templates=tuple(templates),
        sig_tensors=tuple(sig_count),
        sig_dst_numel=tuple(dst_numel),
        sig_dtype=tuple(k[1] for k in sig_keys),
        digest=digest,
    )


def _digest(
    num_src: int,
    worker_class: Sequence[int],
    itemsizes: dict[str, int],
    sources: Sequence[Any],
    sig_keys: Sequence[tuple[Any, ...]],
    layouts: Sequence[SourceLayout],
    regions: _Interner,
    offsets: _Interner,
    tensor_sig: Sequence[int],
    pnames: Sequence[Sequence[str]],
    sig_first: Sequence[int],
) -> str:
    """sha256 over a canonical encoding of everything the plan depends on (no ids, no hash())."""
    h = hashlib.sha256()
    h.update(repr((_DIGEST_VERSION, num_src, tuple(worker_class), sorted(itemsizes.items()))).encode())
    layout_done: set[int] = set()
    for sig, (shape, dtype, lid, fl) in enumerate(sig_keys):
        if lid not in layout_done:
            layout_done.add(lid)
            regs = sources[sig_first[sig]].regions
            h.update(repr(("src", lid, shape, tuple((r.offsets, r.sizes) for r in regs))).encode())
        pieces = tuple(
            (fl[f], regions.values[fl[f + 1]].offsets, regions.values[fl[f + 1]].sizes, offsets.values[fl[f + 2]])
            for f in range(0, len(fl), 3)
        )
        h.update(repr(("sig", sig, shape, dtype, lid, pieces)).encode())
    # Per tensor: name, signature, param of each piece (the signature fixes how many), NUL-joined;
    # repr instead if some name holds a NUL, so the encoding stays unambiguous.
    # A tensor whose pieces all land in one param name (the usual case) writes that name once.
    records = [
        (s.name, str(sig), "1", p[0]) if p and p.count(p[0]) == len(p) else (s.name, str(sig), "0", *p)
        for s, sig, p in zip(sources, tensor_sig, pnames)
    ]
    blob = "\0".join(chain.from_iterable(records))
    if blob.count("\0") != sum(map(len, records)) - 1 and records:
        blob = repr(records)
    h.update(blob.encode("utf-8", "surrogatepass"))
    return h.hexdigest()
