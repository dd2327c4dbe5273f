"""The transfer plan: which trainer rank sends which piece of which tensor to which worker.

Inputs are plain data: one :class:`TensorSource` per HF tensor (the region each trainer rank holds)
and, per worker, the :class:`DestPiece` list of where regions of HF tensors land in its vLLM
parameters. :func:`build_plan` intersects them into a :class:`TransferPlan`. Call order on every rank
of a sync group::

    plan = build_plan(sources, destinations)      # same inputs everywhere -> same plan
    agree on plan.digest over the control plane   # before any data moves
    plan.pairs(rank, sender=...)                  # this rank's side, per peer (PairItems)
    weightsync.plan.schedule.pair_rounds(pairs, ...)  # cut into messages and rounds

The plan is compact: at model scale (tens of thousands of tensors, hundreds of ranks) an item list is
hundreds of millions long, so nothing here is per item. Destination lists that are equal form one
*worker class*; tensors whose shape, dtype, source regions and per-class destination regions are
equal form one *signature*, planned once into a :class:`~weightsync.plan.template.Template`.
:class:`PairItems` gives a rank's side per peer: the signatures whose tensors it exchanges with that
peer and the planned copies of one tensor of each, shared by every tensor of the signature. The items
between one (trainer, worker) pair come in *pair order* (signatures in plan order, then their tensors
in sources order, then the copies of each in plan order); both ends see the same sequence.

Pure: no torch import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from itertools import chain, repeat
from operator import attrgetter, le, lt
from typing import Generic, NamedTuple, TypeVar, cast

from weightsync.plan.regions import Region, _int_tuple
from weightsync.plan.template import RecvProto, SendProto, SourceLayout, Template, plan_template, source_layout

__all__ = [
    "Compact",
    "DestPiece",
    "PairItems",
    "PlanCoverage",
    "TensorSource",
    "TransferItem",
    "TransferPlan",
    "align_up",
    "build_plan",
    "dtype_itemsize",
    "new_item",
]


_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "half": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "float": 4,
    "int64": 8, "uint64": 8, "float64": 8, "double": 8, "complex64": 8, "complex128": 16,
}


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named like torch (``"bfloat16"`` or ``"torch.bfloat16"``)."""
    size = _ITEMSIZE.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else None
    if size is None:
        raise ValueError(f"dtype {dtype!r} has no known itemsize; pass itemsize_of (known: {sorted(_ITEMSIZE)})")
    return size


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (the start of the next aligned slot)."""
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class TensorSource:
    """One HF tensor on the trainer side and the region of it each trainer rank holds.

    Regions are checked by :func:`~weightsync.plan.transfer.build_plan` (once per distinct
    ``regions`` object, so share one tuple between tensors of one layout, as
    :func:`~weightsync.plan.regions.source_regions` callers naturally do).
    """

    # HF tensor name (unique among the sources)
    name: str
    # global shape of the tensor
    shape: tuple[int, ...]
    # dtype name, e.g. "bfloat16"; sizes bytes for load balancing and coverage
    dtype: str
    # regions[r]: the region trainer rank r holds (empty allowed; equal regions = replicated)
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"TensorSource.name must be a str, got {self.name!r}")
        if not isinstance(self.dtype, str):
            raise TypeError(f"TensorSource.dtype of {self.name!r} must be a str, got {self.dtype!r}")
        shape = _int_tuple(self.shape, "shape")
        if any(s < 0 for s in shape):
            raise ValueError(f"TensorSource.shape of {self.name!r} must be non-negative, got {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "regions", tuple(self.regions))


@dataclass(frozen=True)
class DestPiece:
    """On one worker: ``region`` of HF tensor ``name`` lands in param ``param`` at ``param_offsets``."""

    # HF tensor name (must be one of the sources)
    name: str
    # region of the global HF tensor this piece takes
    region: Region
    # vLLM parameter name on the worker
    param: str
    # where region.offsets lands in the param (same ndim; the sizes are region.sizes)
    param_offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not isinstance(self.param, str):
            raise TypeError(f"DestPiece name and param must be str, got {self.name!r} and {self.param!r}")
        if not isinstance(self.region, Region):
            raise TypeError(f"DestPiece.region of {self.name!r} must be a Region, got {self.region!r}")
        offsets = _int_tuple(self.param_offsets, "param_offsets")
        if len(offsets) != self.region.ndim or any(o < 0 for o in offsets):
            raise ValueError(
                f"DestPiece.param_offsets of {self.name!r} must be {self.region.ndim} non-negative ints "
                f"(region {self.region}), got {offsets}"
            )
        object.__setattr__(self, "param_offsets", offsets)


@dataclass(frozen=True, slots=True)
class TransferItem:
    """One contiguous-in-index-space copy: a box of one tensor from one trainer rank to one worker."""

    # trainer rank that sends
    src_rank: int
    # worker rank that receives
    dst_rank: int
    # HF tensor name
    name: str
    # the box, in the coordinates of the global HF tensor
    region: Region
    # region.offsets relative to the sender's local shard
    src_offsets: tuple[int, ...]
    # vLLM parameter on the worker that receives it
    param: str
    # where region.offsets lands in that param (sizes are region.sizes)
    param_offsets: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements moved."""
        return self.region.numel


# The slot descriptors of TransferItem's fields, for new_item below.
(_set_src_rank, _set_dst_rank, _set_name, _set_region, _set_src_offsets, _set_param,
 _set_param_offsets) = (TransferItem.__dict__[f.name].__set__ for f in fields(TransferItem))
_new_object = object.__new__


def new_item(
    src_rank: int, dst_rank: int, name: str, region: Region, src_offsets: tuple[int, ...], param: str,
    param_offsets: tuple[int, ...],
) -> TransferItem:
    """``TransferItem(...)`` for values the planner already checked, twice as fast.

    The frozen ``__init__`` calls ``object.__setattr__`` once per field; writing the slots
    directly skips that, which matters when a rank lists millions of items.
    """
    item = _new_object(TransferItem)
    _set_src_rank(item, src_rank)
    _set_dst_rank(item, dst_rank)
    _set_name(item, name)
    _set_region(item, region)
    _set_src_offsets(item, src_offsets)
    _set_param(item, param)
    _set_param_offsets(item, param_offsets)
    return item


@dataclass(frozen=True)
class PlanCoverage:
    """Bytes a plan moves, against the least it could move (what the workers ask for)."""

    # bytes each worker receives
    recv_bytes: tuple[int, ...]
    # bytes each trainer rank sends
    send_bytes: tuple[int, ...]
    # bytes each worker asks for (sum of its destination pieces)
    lower_bound: tuple[int, ...]

    @property
    def ratio(self) -> float:
        """Received over asked-for bytes: exactly 1.0 when no byte reaches a worker twice."""
        want = sum(self.lower_bound)
        return sum(self.recv_bytes) / want if want else 1.0


_DIGEST_VERSION = "weightsync.plan.transfer/1"


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


_H = TypeVar("_H", bound=Hashable)


class _Interner(Generic[_H]):
    """Map values to small ints; ``by_id`` memoizes by identity (callers keep the objects alive)."""

    def __init__(self) -> None:
        self.by_id: dict[int, int] = {}
        self.by_value: dict[_H, int] = {}
        self.values: list[_H] = []

    def intern(self, value: _H) -> int:
        """Index of ``value`` (equal values get equal indices)."""
        idx = self.by_value.get(value)
        if idx is None:
            idx = self.by_value[value] = len(self.values)
            self.values.append(value)
        self.by_id[id(value)] = idx
        return idx

    def ids_by_identity(self, objs: list[_H]) -> list[int]:
        """Indices of ``objs``, interning each distinct object once (C-level passes otherwise)."""
        by_id = self.by_id
        for key, obj in dict(zip(map(id, objs), objs)).items():
            if key not in by_id:
                self.intern(obj)
        return list(map(by_id.__getitem__, map(id, objs)))

    def ids_by_value(self, objs: list[_H]) -> list[int]:
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
    regions: _Interner[Region]
    # the distinct param offsets of all pieces
    offsets: _Interner[tuple[int, ...]]


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
    # per signature: number of tensors (not ``count``: a tuple's method)
    counts: list[int]
    # per tensor: index of its signature
    of_tensor: list[int]


def _index_sources(sources: Sequence[TensorSource]) -> _Sources:
    """Step 1: check the sources and validate each distinct (shape, regions) layout once.

    Layouts are recognized by the identity of the ``regions`` tuple first, then by value.
    """
    name_index: dict[str, int] = {}
    layouts: list[SourceLayout] = []
    by_id: dict[tuple[int, tuple[int, ...]], int] = {}
    by_value: dict[tuple[tuple[int, ...], tuple[Region, ...]], int] = {}
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
    w: int,
    pieces: Sequence[DestPiece],
    name_index: dict[str, int],
    regions: _Interner[Region],
    offsets: _Interner[tuple[int, ...]],
) -> _Entries:
    """Compact one worker's destination list (C-level passes: this runs on ~10^6 pieces)."""
    pieces = list(pieces)
    if not set(map(type, pieces)) <= {DestPiece}:
        bad = next((p for p in pieces if not isinstance(p, DestPiece)), None)
        if bad is not None:
            raise TypeError(f"destinations[{w}] must hold DestPiece objects, got {bad!r}")
    names = list(map(_NAME, pieces))
    ts = cast("list[int]", list(map(name_index.get, names)))  # None where a name is unknown: raises below
    if None in ts:
        p = pieces[cast("list[int | None]", ts).index(None)]
        raise ValueError(f"destination piece on worker {w} names unknown tensor {p.name!r} (param {p.param!r})")
    rids = regions.ids_by_identity(list(map(_REGION, pieces)))
    oids = offsets.ids_by_value(list(map(_OFFSETS, pieces)))
    params: list[str] = list(map(_PARAM, pieces))
    if not all(map(le, ts, ts[1:])):
        order = sorted(range(len(ts)), key=ts.__getitem__)
        ts, rids, oids, params = cast(  # each column reordered alike (a generator: one type per column)
            "tuple[list[int], list[int], list[int], list[str]]",
            ([col[j] for j in order] for col in (ts, rids, oids, params)))
    return _Entries(ts, rids, oids, params)


def _group_workers(destinations: Sequence[Sequence[DestPiece]], name_index: dict[str, int]) -> _Classes:
    """Step 2: group workers whose destination lists are equal into classes.

    One list object shared by several workers is compacted once (recognized by identity).
    """
    regions: _Interner[Region]
    offsets: _Interner[tuple[int, ...]]
    regions, offsets = _Interner(), _Interner()
    class_of_list: dict[int, int] = {}
    class_by_key: dict[tuple[tuple[int | str, ...], ...], int] = {}
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
        cols: list[Iterable[int]] = []
        for c, e in enumerate(classes):
            cols += (repeat(c), e.region_ids, e.offset_ids)
        flats: Iterator[tuple[int, ...]] = zip(*cols)
        pns: Iterator[tuple[str, ...]] = zip(*(e.params for e in classes))
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


def _group_tensors(
    sources: Sequence[TensorSource], layout_of: Sequence[int], flat: Sequence[tuple[int, ...]]
) -> _Signatures:
    """Step 3: group tensors with equal signatures (shape, dtype, source layout, flat pieces)."""
    index: dict[tuple[tuple[int, ...], str, int, tuple[int, ...]], int] = {}
    sigs = _Signatures([], [], [], [])
    for t, (s, lid, fl) in enumerate(zip(sources, layout_of, flat)):
        key = (s.shape, s.dtype, lid, fl)
        sig = index.setdefault(key, len(sigs.keys))
        if sig == len(sigs.keys):
            sigs.keys.append(_SigKey(*key))
            sigs.first.append(t)
            sigs.counts.append(0)
        sigs.counts[sig] += 1
        sigs.of_tensor.append(sig)
    return sigs


def _plan_signatures(
    sources: Sequence[TensorSource], src: _Sources, classes: _Classes, sigs: _Signatures, itemsizes: dict[str, int]
) -> tuple[list[Template], list[tuple[int, ...]]]:
    """Step 4: plan each signature once, in order (sender load accumulates across signatures).

    Returns the templates and, per signature, the elements each worker asks for per tensor.
    """
    load = [0] * src.num_src
    overlap_cache: dict[tuple[int, Region], list[tuple[int, Region]]] = {}
    regions, offsets = classes.regions.values, classes.offsets.values
    templates, dst_numel = [], []
    for key, first, count in zip(sigs.keys, sigs.first, sigs.counts):
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
    sources: Sequence[TensorSource], destinations: Sequence[Sequence[DestPiece]], itemsize_of: Callable[[str], int]
) -> Compact:
    """Validate, group and plan; see :func:`weightsync.plan.transfer.build_plan` for the rules.

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
        sig_tensors=tuple(sigs.counts),
        sig_dst_numel=tuple(dst_numel),
        sig_dtype=tuple(k.dtype for k in sigs.keys),
        digest=digest,
    )


def _digest(
    src: _Sources,
    classes: _Classes,
    itemsizes: dict[str, int],
    sources: Sequence[TensorSource],
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


class TransferPlan:
    """A deterministic M2N plan; build it with :func:`build_plan`, read it on any rank.

    Items follow one global order: tensors in ``sources`` order, then worker rank, then the
    worker's piece order for that tensor, then the piece's overlaps by offset. So the items between
    one (trainer, worker) pair come in the same sequence on both ends (:meth:`pairs`). The
    item-by-item listings of a plan live with the tests, as the oracle (``tests/oracle.py``).
    """

    def __init__(self, compact: Compact, itemsize_of: Callable[[str], int]) -> None:
        self._c = compact
        self._itemsize_of = itemsize_of
        self._members: tuple[tuple[int, ...], ...] | None = None

    @property
    def compact(self) -> Compact:
        """The plan itself: worker classes, signatures and one template per signature."""
        return self._c

    @property
    def digest(self) -> str:
        """Hex sha256 of the canonical inputs; equal on ranks with equal inputs, else different."""
        return self._c.digest

    @property
    def num_src_ranks(self) -> int:
        """Number of trainer ranks."""
        return self._c.num_src

    @property
    def num_dst_ranks(self) -> int:
        """Number of workers."""
        return self._c.num_dst

    @property
    def num_tensors(self) -> int:
        """Number of HF tensors in the sources."""
        return len(self._c.names)

    @property
    def num_signatures(self) -> int:
        """Number of distinct layouts, each planned once."""
        return len(self._c.templates)

    @property
    def num_items(self) -> int:
        """Total number of items over all ranks."""
        c = self._c
        return sum(t.count * n for t, n in zip(c.templates, c.sig_tensors))

    def __repr__(self) -> str:
        return (
            f"TransferPlan(tensors={self.num_tensors}, src_ranks={self.num_src_ranks}, "
            f"dst_ranks={self.num_dst_ranks}, items={self.num_items}, digest={self.digest[:12]})"
        )

    def _check(self, rank: int, n: int, what: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
            raise ValueError(f"{what} must be an int in [0, {n}), got {rank!r}")

    def pairs(self, rank: int, *, sender: bool) -> PairItems:
        """Trainer ``rank``'s (``sender``) or worker ``rank``'s items per peer, compact: what the
        M2N executor cuts into messages, without listing every item (see :class:`PairItems`)."""
        self._check(rank, self.num_src_ranks if sender else self.num_dst_ranks, "rank")
        if self._members is None:
            members: list[list[int]] = [[] for _ in self._c.templates]
            for t, sig in enumerate(self._c.tensor_sig):
                members[sig].append(t)
            self._members = tuple(map(tuple, members))
        return PairItems(self._c, self._members, rank, sender=sender)

    def coverage(self, itemsize_of: Callable[[str], int] | None = None) -> PlanCoverage:
        """Bytes received per worker, sent per trainer rank, and asked for per worker."""
        size_of = itemsize_of or self._itemsize_of
        c = self._c
        recv = [0] * c.num_dst
        send = [0] * c.num_src
        want = [0] * c.num_dst
        for tpl, n, dtype, numels in zip(c.templates, c.sig_tensors, c.sig_dtype, c.sig_dst_numel):
            scale = n * size_of(dtype)
            for w, choice in enumerate(tpl.choices):
                want[w] += numels[w] * scale
                for r, p in zip(choice, tpl.protos[c.worker_class[w]]):
                    recv[w] += p.numel * scale
                    send[r] += p.numel * scale
        return PlanCoverage(tuple(recv), tuple(send), tuple(want))

    def bytes_per_dst(self, itemsize_of: Callable[[str], int] | None = None) -> tuple[int, ...]:
        """Bytes each worker receives."""
        return self.coverage(itemsize_of).recv_bytes


class PairItems:
    """What one rank sends to (``sender``) or receives from each peer; build it with
    :meth:`TransferPlan.pairs`. Holds O(peers x signatures) entries, not one per item."""

    def __init__(self, compact: Compact, members: Sequence[tuple[int, ...]], rank: int, *, sender: bool) -> None:
        self.compact, self.members, self.rank, self.sender = compact, members, rank, sender
        runs: dict[int, list[tuple[int, tuple[SendProto | RecvProto, ...]]]] = {}
        wc = compact.worker_class
        for sig, tpl in enumerate(compact.templates):
            protos = tpl.protos_for_src(rank, wc) if sender else tpl.protos_for_dst(rank, wc)
            by_peer: dict[int, list[SendProto | RecvProto]] = {}
            for p in protos:  # SendProto.dst / RecvProto.src first: the peer
                by_peer.setdefault(p[0], []).append(p)
            for peer, ps in by_peer.items():
                runs.setdefault(peer, []).append((sig, tuple(ps)))
        self.runs: dict[int, tuple[tuple[int, tuple[SendProto | RecvProto, ...]], ...]] = {
            peer: tuple(runs[peer]) for peer in sorted(runs)}
        """Per peer (ascending): its (signature, planned copies) in pair order."""

    @property
    def peers(self) -> tuple[int, ...]:
        """The peers this rank exchanges anything with, ascending."""
        return tuple(self.runs)

    def count(self, peer: int | None = None) -> int:
        """Number of items with ``peer`` (all peers when None)."""
        peers = self.runs if peer is None else (peer,)
        return sum(len(self.members[sig]) * len(ps) for p in peers for sig, ps in self.runs.get(p, ()))

    def nbytes(self, itemsize_of: Callable[[str], int]) -> int:
        """Bytes of all items (``itemsize_of`` maps a dtype name to bytes per element)."""
        dtypes = self.compact.sig_dtype
        return sum(len(self.members[sig]) * sum(p.region.numel for p in ps) * itemsize_of(dtypes[sig])
                   for runs in self.runs.values() for sig, ps in runs)

    def items(self, peer: int) -> Iterator[TransferItem]:
        """The items with ``peer``, in pair order (made as they are consumed)."""
        names, params = self.compact.names, self.compact.params
        src, dst = (self.rank, peer) if self.sender else (peer, self.rank)
        for sig, protos in self.runs.get(peer, ()):
            for t in self.members[sig]:
                name, pn = names[t], params[t]
                for p in protos:
                    yield new_item(src, dst, name, p.region, p.src_offsets, pn[p.piece], p.param_offsets)


def build_plan(
    sources: Sequence[TensorSource],
    destinations: Sequence[Sequence[DestPiece]],
    *,
    itemsize_of: Callable[[str], int] | None = None,
) -> TransferPlan:
    """Plan every byte every worker asks for; call with equal inputs on every rank, then agree on the digest.

    ``destinations[w]`` lists worker w's pieces. Every byte of every piece becomes exactly one
    item. A piece held by several trainer ranks (equal source regions) goes to the holder that
    sends the fewest bytes so far, ties to the lowest rank (as torch DCP's ``dedup_save_plans``).
    Tensors sharing a layout (shape, dtype, source regions, per-worker destination regions and
    param offsets; names aside) are planned once, in order of first appearance, their bytes
    counted once per tensor. The order of pieces of *different* tensors in a worker's list does
    not matter. Equal destination lists are recognized by identity first: pass one list object
    for workers with identical layouts (e.g. one TP rank in several replicas) at model scale.

    Raises ValueError (naming the tensor, worker or trainer rank and both values) for an unknown
    tensor name, a piece whose ndim or bounds do not fit the tensor, a piece not covered by the
    source regions, source regions that overlap without being equal, or disagreeing rank counts.
    ``itemsize_of`` maps a dtype name to bytes per element (default :func:`dtype_itemsize`).
    """
    size_of = itemsize_of or dtype_itemsize
    return TransferPlan(compact_plan(sources, destinations, size_of), size_of)
