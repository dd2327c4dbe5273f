"""Model agreement and coverage on a worker, before any data moves (reads the model, changes nothing).

Given the trainer's metadata (HF name, dtype name, shape of every tensor one sync sends) and this
worker's live vLLM model, :func:`check_model` raises ``ValueError`` naming the parameter and both
values for:

* a tensor the model has no place for (an extra tensor, a misspelt name);
* a tensor whose shape is not what the layer was built for: a smaller *or larger* trainer model,
  another vocabulary size, other heads (:func:`~weightsync.worker.destinations.resolve_destinations`);
* a dtype other than the parameter's, unless ``cast_dtypes`` (floating point to floating point
  only: the workers cast on receive, as vLLM's loader casts a checkpoint in another dtype);
* **coverage**: a region of a live parameter that no tensor of the sync writes (a source that
  omits a tensor, e.g. ``up_proj``, one half of the fused ``gate_up_proj``), computed with
  :func:`weightsync.plan.regions.uncovered` from the regions the sync places on this worker.
  Not required: a vocabulary's padding rows (vLLM zeroes them), parameters vLLM's processing
  derived (not in the checkpoint layout), block-FP8 scales (the workers compute them), the
  attention's KV-cache scales of an FP8 model (optional in checkpoints: vLLM keeps its defaults),
  and the parameters named in ``partial``.

Every transport runs it: M2N on the regions of its plan (``_init``), the full-tensor transports
(nccl, ipc) on the metadata whose tensors will reach the parameters' loaders whole, at init and
again whenever an update carries different metadata. Before that, their trainer ranks agree on one
metadata among themselves (:func:`agree_on_metadata`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..control import Listing, agree, model_digest, model_metas
from ..plan.buckets import metadata_digest
from ..plan.regions import Region, format_regions, uncovered
from .destinations import UNKNOWN, WorkerDestinations, checkpoint_layout, layout_recorded, resolve_destinations
from .fp8 import check_sent_dtype, kv_cache_scale

if TYPE_CHECKING:
    from ..comm import Communicator

__all__ = ["agree_on_metadata", "check_model", "coverage_gaps", "fingerprint", "weights_changed"]

_VOCAB = ("VocabParallelEmbedding", "ParallelLMHead")


SOURCE_DTYPE = {"full": "FullTensorSource(dtype=...)", "local": "DTensorModuleSource(..., dtype=...)"}
"""How a dtype refusal tells the trainer to send the engine's dtype, per source kind (``Transport.source``)."""


def check_model(model: torch.nn.Module, metas: Sequence[tuple[str, str, Sequence[int]]], *,
                cast_dtypes: bool = False, partial: Sequence[str] = (), source: str = "full") -> WorkerDestinations:
    """This worker's destinations for ``metas`` once they agree with ``model`` (see the module
    docstring for what is refused); ``partial``: vLLM parameter names (or module prefixes) the
    sync may leave as they are; ``source``: the kind of source the transport reads (``"full"``,
    ``"local"``), named in a dtype refusal's hint."""
    dests = resolve_destinations(model, metas)
    unknown = [f.name for f in dests.fallbacks if f.reason == UNKNOWN]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ValueError(f"parameter {unknown[0]!r}{more}: the trainer sends it, but vLLM's "
                         f"{type(model).__name__} has no parameter or fused layer for it (the source's "
                         "name_map= maps the trainer's names to the checkpoint's)")
    _check_dtypes(dests, metas, cast_dtypes, SOURCE_DTYPE.get(source, SOURCE_DTYPE["full"]))
    gaps = coverage_gaps(model, dests, partial)
    if gaps:
        name, shape, left = gaps[0]
        more = f" ({len(gaps) - 1} more parameter(s) uncovered)" if len(gaps) > 1 else ""
        raise ValueError(f"parameter {name!r}: no tensor of this sync writes {format_regions(left)} of its "
                         f"{shape} on this TP rank{_missing_hint(model, name, metas)}{more}; a sync must write "
                         "every vLLM parameter (leave one out on purpose with the init info's partial=(...))")
    return dests


def _check_dtypes(dests: WorkerDestinations, metas: Sequence[tuple[str, str, Sequence[int]]], cast: bool,
                  source: str) -> None:
    sent = {name: dtype for name, dtype, _ in metas}
    quantized = set(dests.quantized)
    for p in dests.placed:
        have, want = sent[p.name], dests.param_dtypes.get(p.param)
        if p.param in quantized:  # block FP8: the worker quantizes what it receives
            check_sent_dtype(p.name, have, p.param)
            continue
        if want is None or have == want:
            continue
        floats = all(getattr(torch, d).is_floating_point for d in (have, want))
        if not cast or not floats:
            hint = (f"send the engine's dtype ({source}) or set cast_dtypes=True in the "
                    "trainer's init info" if floats else "a cast between these kinds would change the values")
            raise ValueError(f"parameter {p.name!r}: the trainer sends {have}, vLLM's {p.param} holds {want} "
                             f"({hint})")


def coverage_gaps(model: torch.nn.Module, dests: WorkerDestinations,
                  partial: Sequence[str] = ()) -> list[tuple[str, tuple[int, ...], list[Region]]]:
    """``(vLLM parameter, its checkpoint-layout shape, regions no tensor writes)`` for every live
    parameter of ``model`` that ``dests`` leaves partly unwritten (padding and ``partial`` excluded)."""
    written: dict[str, list[Region]] = {}
    for p in dests.placed:
        written.setdefault(p.param, []).append(Region(tuple(p.param_offsets), tuple(p.region.sizes)))
    reached = set(dests.reached)  # whole tensors through a loader we cannot see into: taken as covering it
    reached.update(dests.derived)  # block-FP8 scales: the worker computes them from the weights it receives
    modules = dict(model.named_modules())
    layouts: dict[str, dict[str, torch.Tensor]] = {}
    gaps = []
    for name, live in model.named_parameters():
        if name in reached or any(name == x or name.startswith(x + ".") for x in partial):
            continue
        path, _, attr = name.rpartition(".")
        if kv_cache_scale(modules[path], attr):
            continue  # optional in a checkpoint (kv_cache_scheme), not in a trainer's model
        layout = layouts.setdefault(path, checkpoint_layout(modules[path]))
        if attr not in layout and (layout or layout_recorded(modules[path])):
            continue  # derived by vLLM's processing, not part of the checkpoint
        shape = tuple(int(s) for s in (layout[attr].shape if attr in layout else live.shape))
        left = uncovered(shape, written.get(name, []) + _padding(modules[path], live, shape))
        if left:
            gaps.append((name, shape, left))
    return gaps


def _padding(module: Any, param: torch.Tensor, shape: tuple[int, ...]) -> list[Region]:
    """The rows of a vocabulary-parallel weight past this rank's original vocabulary (vLLM zeroes them)."""
    idx = getattr(module, "shard_indices", None)
    dim = getattr(param, "output_dim", None)
    if type(module).__name__ not in _VOCAB or idx is None or dim is None:
        return []
    rows = idx.org_vocab_end_index - idx.org_vocab_start_index
    if rows >= shape[dim]:
        return []
    return [Region(tuple(rows if d == dim else 0 for d in range(len(shape))),
                   tuple(shape[d] - rows if d == dim else shape[d] for d in range(len(shape))))]


def _missing_hint(model: torch.nn.Module, name: str, metas: Sequence[tuple[str, str, Sequence[int]]]) -> str:
    """Which HF tensors of the trainer's metadata would have written vLLM parameter ``name``."""
    sent = {n for n, _, _ in metas}
    path, _, attr = name.rpartition(".")
    prefix, _, leaf = path.rpartition(".")
    parts = dict(getattr(model, "packed_modules_mapping", {}) or {}).get(leaf)
    candidates = [f"{prefix}.{p}.{attr}" if prefix else f"{p}.{attr}" for p in parts] if parts else [name]
    missing = [c for c in candidates if c not in sent]
    return f" (the trainer's metadata has no {', '.join(map(repr, missing))})" if missing else ""


def agree_on_metadata(comm: Communicator, metadata: Sequence[Any], *, rank: int, num_ranks: int) -> str:
    """Every trainer rank of a full-tensor transport: the ranks agree on their metadata (names, dtypes,
    shapes) with :func:`weightsync.control.agree`; on a difference every rank raises the same
    ``ValueError`` naming the first missing or differing parameter and both ranks' values. Rank 0's
    listing is what the workers check their model against (``model/metas/0``). Returns the digest
    every rank agreed on."""
    mine = [m.wire() for m in metadata]
    return agree(comm, model_digest, metadata_digest(mine), rank=rank, ranks=num_ranks, what="metadata",
                 who="trainer rank", listing=Listing(model_metas, mine, lambda m: m["name"], _short))


def _short(meta: Any) -> str:
    return f"{meta['dtype']} {tuple(meta['shape'])}"


Fingerprint = tuple[list[tuple[str, int, int]], list[torch.Tensor]]
_SAMPLES = 16


@torch.no_grad()
def fingerprint(model: torch.nn.Module) -> Fingerprint:
    """Cheap identity of ``model``'s parameters: each one's object and storage address, and the raw bits of
    17 of its values spread over it (first to last; a copy of a few hundred bytes per parameter, on its
    device, in one concatenation per dtype). Torch's in-place version counter would not do: vLLM's weight
    loaders write through ``param.data``, which bumps no counter."""
    ids, by_dtype = [], {}
    for name, t in model.named_parameters():
        if t.is_meta:
            continue
        ids.append((name, id(t), t.data_ptr()))
        by_dtype.setdefault(t.dtype, []).extend(_samples(t.detach()))
    # sorted by the dtype's name only: ``key=str`` on the items formatted every sampled tensor (~10 ms a call)
    return ids, [torch.cat(by_dtype[d]).contiguous().view(torch.uint8) for d in sorted(by_dtype, key=str)]


def _samples(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``_SAMPLES`` values of ``t`` from its first, evenly spaced, and its last: two views of a
    contiguous tensor (this runs per parameter at every worker start and finish: ~1,000 on a large MoE)."""
    n = t.numel()
    if not t.is_contiguous() or n == 0:
        flat = t.reshape(-1)
        return flat[:: max(1, n // _SAMPLES)][:_SAMPLES], flat[-1:]
    step, at = max(1, n // _SAMPLES), t.storage_offset()
    return t.as_strided((min(n, _SAMPLES),), (step,), at), t.as_strided((1,), (1,), at + n - 1)


def weights_changed(before: Fingerprint | None, model: torch.nn.Module) -> bool:
    """Whether vLLM changed ``model``'s weights since ``before``: a parameter replaced or moved
    (``reload_weights``, a level-2 sleep) or its values rewritten (``load_weights`` of other weights;
    a rewrite of the same values does not count, nor a buffer vLLM's forward recasts)."""
    if before is None:
        return True
    ids, samples = fingerprint(model)
    return ids != before[0] or len(samples) != len(before[1]) or not all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(samples, before[1]))
