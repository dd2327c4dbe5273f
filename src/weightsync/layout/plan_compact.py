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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, le, lt
from typing import Any, NamedTuple

from weightsync.layout.plan_template import SourceLayout, Template, plan_template, source_layout
from weightsync.layout.records import DestPiece, TensorSource
from weightsync.layout.regions import Region

__all__ = ["Compact", "compact_plan"]

_DIGEST_VERSION = "weightsync.layout.plan/1"


@dataclass(frozen=True)
class Compact:
    """Everything a :class:`TransferPlan` answers from; built by :func:`compact_plan`."""

    # number of trainer (source) ranks
    num_src: int
    # number of workers (destination ranks)
    num_dst: int
    # worker_class[w]: class of worker w; workers of one class want identical pieces
    worker_class: tuple[int, ...]
    # per tensor, in sources order: HF name
    names: tuple[str, ...]
    # per tensor: dtype name
    dtypes: tuple[str, ...]
    # per tensor: index of its signature (in templates)
    tensor_sig: tuple[int, ...]
    # per tensor: the param name of each of its pieces, in flat piece order (see _flatten)
    params: tuple[tuple[str, ...], ...]
    # per signature: the plan shared by its tensors
    templates: tuple[Template, ...]
    # per signature: number of tensors that have it
    sig_tensors: tuple[int, ...]
    # per signature: elements each worker asks for, per tensor
    sig_dst_numel: tuple[tuple[int, ...], ...]
    # per signature: dtype name
    sig_dtype: tuple[str, ...]
    # sha256 hex of the canonical encoding of the whole plan
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


class _Sources(NamedTuple):
    """Step 1's result: the validated sources, indexed."""

    # name -> index in sources
    name_index: dict[str, int]
    # distinct source layouts (shape and regions), each validated once
    layouts: list[SourceLayout]
    # per tensor: index of its layout
    layout_of: list[int]
    # number of trainer ranks
    num_src: int


class _Entries(NamedTuple):
    """One worker class's pieces, column-wise and stably ordered by tensor index."""

    # per piece: the tensor's index in sources
    tensors: list[int]
    # per piece: id of its region (in _Classes.regions)
    region_ids: list[int]
    # per piece: id of its param offsets (in _Classes.offsets)
    offset_ids: list[int]
    # per piece: the vLLM param name
    params: list[str]


class _Classes(NamedTuple):
    """Step 2's result: workers grouped into classes of equal destination lists."""

    # worker_class[w]: class of worker w
    worker_class: list[int]
    # per class: its pieces
    entries: list[_Entries]
    # per class: its workers, ascending
    workers: list[list[int]]
    # the distinct regions of all pieces
    regions: _Interner
    # the distinct param offsets of all pieces
    offsets: _Interner


class _SigKey(NamedTuple):
    """What makes two tensors plannable as one: their signature."""

    # global shape
    shape: tuple[int, ...]
    # dtype name
    dtype: str
    # index of the source layout
    layout: int
    # the pieces of every class, flat: (class, region id, offsets id) per piece (see _flat_pieces)
    flat: tuple[int, ...]


class _Signatures(NamedTuple):
    """Step 3's result: tensors grouped by signature, in order of first appearance."""

    # per signature: its key
    keys: list[_SigKey]
    # per signature: index of its first tensor (names it in errors)
    first: list[int]
    # per signature: number of tensors
    count: list[int]
    # per tensor: index of its signature
    of_tensor: list[int]


def _index_sources(sources: Sequence[Any]) -> _Sources:
    """Step 1: check the sources and validate each distinct (shape, regions) layout once.

    Layouts are recognized by the identity of the ``regions`` tuple first, then by value.
    """
    name_index: dict[str, int] = {}
    layouts: list[SourceLayout] = []
    by_id: dict[tuple[int, tuple[int, ...]], int] = {}
    by_value: dict[tuple[Any, ...], int] = {}
    layout_of = []
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
        lid = by_id.get(key)
        if lid is None:
            lid = by_value.setdefault((s.shape, s.regions), len(layouts))
            if lid == len(layouts):
                layouts.append(source_layout(s.name, s.shape, s.regions))
            by_id[key] = lid
        layout_of.append(lid)
    return _Sources(name_index, layouts, layout_of, num_src)


_NAME, _REGION, _OFFSETS, _PARAM = (attrgetter(a) for a in ("name", "region", "param_offsets", "param"))


def _worker_entries(
    w: int, pieces: Sequence[Any], name_index: dict[str, int], regions: _Interner, offsets: _Interner
) -> _Entries:
    """Compact one worker's destination list (C-level passes: this runs on ~10^6 pieces)."""
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
    rids = regions.ids_by_identity(list(map(_REGION, pieces)))
    oids = offsets.ids_by_value(list(map(_OFFSETS, pieces)))
    params: list[Any] = list(map(_PARAM, pieces))
    if not all(map(le, ts, ts[1:])):
        order = sorted(range(len(ts)), key=ts.__getitem__)
        ts, rids, oids, params = ([col[j] for j in order] for col in (ts, rids, oids, params))
    return _Entries(ts, rids, oids, params)


def _group_workers(destinations: Sequence[Sequence[Any]], name_index: dict[str, int]) -> _Classes:
    """Step 2: group workers whose destination lists are equal into classes.

    One list object shared by several workers is compacted once (recognized by identity).
    """
    regions, offsets = _Interner(), _Interner()
    class_of_list: dict[int, int] = {}
    class_by_key: dict[tuple[Any, ...], int] = {}
    entries: list[_Entries] = []
    worker_class = []
    for w, pieces in enumerate(destinations):
        c = class_of_list.get(id(pieces))
        if c is None:
            e = _worker_entries(w, pieces, name_index, regions, offsets)
            c = class_by_key.setdefault(tuple(tuple(col) for col in e), len(entries))
            if c == len(entries):
                entries.append(e)
            class_of_list[id(pieces)] = c
        worker_class.append(c)
    workers: list[list[int]] = [[] for _ in entries]
    for w, c in enumerate(worker_class):
        workers[c].append(w)
    return _Classes(worker_class, entries, workers, regions, offsets)


def _flatten(n: int, classes: Sequence[_Entries]) -> tuple[list[tuple[int, ...]], list[tuple[str, ...]]]:
    """Per tensor: its pieces over all classes as one flat tuple ``(class, region id, offsets id) * k``
    (a hashable part of the signature), and the param name of each of those k pieces."""
    ts0 = classes[0].tensors if classes else []
    if all(e.tensors == ts0 for e in classes) and all(map(lt, ts0, ts0[1:])):
        # Common case: every class takes each tensor at most once, in one order: zip the columns.
        cols: list[Any] = []
        for c, e in enumerate(classes):
            cols += (repeat(c), e.region_ids, e.offset_ids)
        flats: Any = zip(*cols)
        pns: Any = zip(*(e.params for e in classes))
        if ts0 == list(range(n)):
            return list(flats), list(pns)
        flat_of: list[tuple[int, ...]] = [()] * n
        pn_of: list[tuple[str, ...]] = [()] * n
        for t, fl, pn in zip(ts0, flats, pns):
            flat_of[t], pn_of[t] = fl, pn
        return flat_of, pn_of
    flat: list[list[int]] = [[] for _ in range(n)]
    pnames: list[list[str]] = [[] for _ in range(n)]
    for c, e in enumerate(classes):
        for t, rid, oid, param in zip(*e):
            flat[t] += (c, rid, oid)
            pnames[t].append(param)
    return list(map(tuple, flat)), list(map(tuple, pnames))


def _flat_pieces(flat: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """``(class, region id, offsets id)`` of each piece in a flat tuple from :func:`_flatten`."""
    return zip(flat[0::3], flat[1::3], flat[2::3])


def _group_tensors(sources: Sequence[Any], layout_of: Sequence[int], flat: Sequence[tuple[int, ...]]) -> _Signatures:
    """Step 3: group tensors with equal signatures (shape, dtype, source layout, flat pieces)."""
    index: dict[tuple[Any, ...], int] = {}
    sigs = _Signatures([], [], [], [])
    for t, (s, lid, fl) in enumerate(zip(sources, layout_of, flat)):
        key = (s.shape, s.dtype, lid, fl)
        sig = index.setdefault(key, len(sigs.keys))
        if sig == len(sigs.keys):
            sigs.keys.append(_SigKey(*key))
            sigs.first.append(t)
            sigs.count.append(0)
        sigs.count[sig] += 1
        sigs.of_tensor.append(sig)
    return sigs


def _plan_signatures(
    sources: Sequence[Any], src: _Sources, classes: _Classes, sigs: _Signatures, itemsizes: dict[str, int]
) -> tuple[list[Template], list[tuple[int, ...]]]:
    """Step 4: plan each signature once, in order (sender load accumulates across signatures).

    Returns the templates and, per signature, the elements each worker asks for per tensor.
    """
    load = [0] * src.num_src
    overlap_cache: dict[tuple[int, Region], list[tuple[int, Region]]] = {}
    regions, offsets = classes.regions.values, classes.offsets.values
    templates, dst_numel = [], []
    for key, first, count in zip(sigs.keys, sigs.first, sigs.count):
        class_pieces: list[list[tuple[int, Region, tuple[int, ...]]]] = [[] for _ in classes.entries]
        for piece, (c, rid, oid) in enumerate(_flat_pieces(key.flat)):
            class_pieces[c].append((piece, regions[rid], offsets[oid]))
        templates.append(plan_template(
            sources[first].name, key.shape, itemsizes[key.dtype], src.layouts[key.layout], class_pieces,
            classes.workers, classes.worker_class, count, load, overlap_cache,
        ))
        dst_numel.append(tuple(sum(r.numel for _, r, _ in class_pieces[c]) for c in classes.worker_class))
    return templates, dst_numel


def compact_plan(
    sources: Sequence[Any], destinations: Sequence[Sequence[Any]], itemsize_of: Callable[[str], int]
) -> Compact:
    """Validate, group and plan; see :func:`weightsync.layout.plan.build_plan` for the rules.

    Steps: index the sources (1), group workers into classes (2), group tensors into
    signatures (3), plan each signature once (4), digest everything (5).
    """
    sources = tuple(sources)  # keep every object alive: identities are memo keys below
    dests = tuple(destinations)
    src = _index_sources(sources)
    classes = _group_workers(dests, src.name_index)
    flat, pnames = _flatten(len(sources), classes.entries)
    sigs = _group_tensors(sources, src.layout_of, flat)
    del flat
    itemsizes = {dtype: itemsize_of(dtype) for dtype in dict.fromkeys(k.dtype for k in sigs.keys)}
    templates, dst_numel = _plan_signatures(sources, src, classes, sigs, itemsizes)
    digest = _digest(src, classes, itemsizes, sources, sigs, pnames)
    return Compact(
        num_src=src.num_src,
        num_dst=len(dests),
        worker_class=tuple(classes.worker_class),
        names=tuple(s.name for s in sources),
        dtypes=tuple(s.dtype for s in sources),
        tensor_sig=tuple(sigs.of_tensor),
        params=tuple(pnames),
        templates=tuple(templates),
        sig_tensors=tuple(sigs.count),
        sig_dst_numel=tuple(dst_numel),
        sig_dtype=tuple(k.dtype for k in sigs.keys),
        digest=digest,
    )


def _digest(
    src: _Sources,
    classes: _Classes,
    itemsizes: dict[str, int],
    sources: Sequence[Any],
    sigs: _Signatures,
    pnames: Sequence[Sequence[str]],
) -> str:
    """Step 5: sha256 over a canonical encoding of everything the plan depends on (no ids, no hash()).

    Layouts and signatures are written once each, by value; then every tensor's name, signature
    and param names.
    """
    h = hashlib.sha256()
    h.update(repr((_DIGEST_VERSION, src.num_src, tuple(classes.worker_class), sorted(itemsizes.items()))).encode())
    regions, offsets = classes.regions.values, classes.offsets.values
    layout_done: set[int] = set()
    for sig, (key, first) in enumerate(zip(sigs.keys, sigs.first)):
        if key.layout not in layout_done:
            layout_done.add(key.layout)
            regs = sources[first].regions
            h.update(repr(("src", key.layout, key.shape, tuple((r.offsets, r.sizes) for r in regs))).encode())
        pieces = tuple(
            (c, regions[rid].offsets, regions[rid].sizes, offsets[oid]) for c, rid, oid in _flat_pieces(key.flat)
        )
        h.update(repr(("sig", sig, key.shape, key.dtype, key.layout, pieces)).encode())
    # Per tensor: name, signature, param of each piece (the signature fixes how many), NUL-joined;
    # repr instead if some name holds a NUL, so the encoding stays unambiguous.
    # A tensor whose pieces all land in one param name (the usual case) writes that name once.
    records = [
        (s.name, str(sig), "1", p[0]) if p and p.count(p[0]) == len(p) else (s.name, str(sig), "0", *p)
        for s, sig, p in zip(sources, sigs.of_tensor, pnames)
    ]
    blob = "\0".join(chain.from_iterable(records))
    if blob.count("\0") != sum(map(len, records)) - 1 and records:
        blob = repr(records)
    h.update(blob.encode("utf-8", "surrogatepass"))
    return h.hexdigest()
