"""LoRA adapters written into a live vLLM engine's LoRA slots, in memory, per TP shard (issue 39).

vLLM keeps every active adapter in per-layer stacked tensors (``lora_a_stacked[i][slot, 0, :r, :in]``
and ``lora_b_stacked[i][slot, 0, :out, :r]``, ``i`` the slice of a fused layer: q/k/v, gate/up) and
maps an adapter id to a slot with ``lora_index_to_id``; a request's ``LoRARequest`` whose id is
already registered is served from its slot and never loaded from a path. :class:`LoRASlots` uses that:

* :meth:`LoRASlots.plan` resolves every adapter tensor (PEFT's saved names, e.g.
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``) to its layer, fused slice and
  the blocks of it this TP rank holds. The blocks are read from vLLM's own ``slice_lora_a`` /
  ``slice_lora_b`` applied to an index tensor, so the sharding is vLLM's (B sliced for
  column-parallel layers, A for row-parallel ones, q/k/v and gate/up slices with KV-head replicas)
  without a table of ours. An embedding's ``lora_embedding_A`` / ``_B`` go whole to every TP rank, A
  transposed (``[vocab, r]``), as vLLM's ``VocabParallelEmbeddingWithLoRA.set_lora`` writes them.
  Bad input is refused here, naming the field, before anything is written.
* :meth:`LoRASlots.dests` gives the blocks as the reshard plan's destinations (``DestPiece`` s, one
  per block, into the param ``<module>.lora_<a|b>.<slice>``: the slot's 2-D matrix, an embedding's A
  as its transpose); :meth:`LoRASlots.begin` picks a free slot, zeroes it and hands out those
  matrices for the reshard executor to write the received blocks into (casting to the slot's dtype);
  :meth:`LoRASlots.end` then folds the scaling into B as vLLM's loading does
  (``lora_b.to(lora_dtype) *= alpha / r``), so the slot's bytes equal what vLLM makes from the same
  adapter saved to a directory.
* :meth:`LoRASlots.commit` switches the adapter id to the staged slot (the old slot is freed);
  :meth:`LoRASlots.discard` drops a staged slot. Until the commit the previous version serves, so a
  failed sync leaves it serving. Each adapter has its own slot, version and staging.

Slots needed: one per adapter plus one to stage into, so at most ``max_loras - 1`` adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..fingerprint import fingerprint
from ..plan.regions import Region
from ..plan.transfer import DestPiece
from ..protocol import dtype_name
from .destinations import on_other_stage

__all__ = ["LoRABlock", "LoRASlots", "lora_slots", "base_fingerprints"]


@dataclass(frozen=True)
class LoRABlock:
    """A block of one adapter tensor that this worker holds, and where it lands in the slot."""

    name: str  # adapter tensor name (PEFT's saved name)
    region: Region  # the block in the full (unsharded) adapter tensor
    module: str  # vLLM LoRA layer, e.g. ``model.layers.0.self_attn.qkv_proj``
    which: str  # "a" or "b"
    sub: int  # slice of a fused layer (q/k/v, gate/up); 0 otherwise
    at: tuple[int, int]  # (row, col) of the block in the slot's 2-D matrix
    transposed: bool = False  # an embedding's A: the slot holds it transposed (``[vocab, r]``)

    @property
    def param(self) -> str:
        """The slot matrix it lands in, as a destination's param (``slot_tensors``' key)."""
        return f"{self.module}.lora_{self.which}.{self.sub}"


@dataclass
class _Adapter:
    adapter_id: int
    config: dict[str, Any]
    blocks: tuple[LoRABlock, ...]
    scaling: dict[str, float]  # vLLM module name of a tensor -> scaling folded into its B
    slot: int | None = None  # the slot serving the adapter (None before its first commit)
    staged: int | None = None  # the slot a sync is writing into
    version: int | None = None
    received: int = 0  # bytes received by the last stage


def _manager(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", worker)
    wm = getattr(runner, "lora_manager", None)
    if wm is None:
        raise ValueError("the engine has no LoRA layers: start it with enable_lora=True")
    return wm._adapter_manager


def _blocks(idx: torch.Tensor, ncols: int) -> list[tuple[Region, tuple[int, int]]]:
    """The blocks of a 2-D slice ``idx`` of ``arange(rows * ncols).view(rows, ncols)``: runs of
    consecutive source rows over the same columns, with where each lands in ``idx``."""
    out: list[tuple[Region, tuple[int, int]]] = []
    width = idx.shape[1]
    first = idx[:, 0].tolist()
    expect = torch.arange(width, dtype=idx.dtype)
    for i, f in enumerate(first):
        row, col = divmod(int(f), ncols)
        if not torch.equal(idx[i] - f, expect):
            raise ValueError(f"vLLM's LoRA slicing is not a block copy (row {i})")
        if out:
            reg, at = out[-1]
            if (reg.offsets[1] == col and reg.offsets[0] + reg.sizes[0] == row
                    and at[0] + reg.sizes[0] == i):
                out[-1] = (Region(reg.offsets, (reg.sizes[0] + 1, width)), at)
                continue
        out.append((Region((row, col), (1, width)), (i, 0)))
    return out


def _sliced(layer: Any, which: str, sub: int, idx: torch.Tensor) -> torch.Tensor:
    """What vLLM's ``set_lora`` writes into slice ``sub`` for a full tensor (here an index tensor)."""
    if layer.tp_size <= 1:
        return idx
    fn = layer.slice_lora_a if which == "a" else layer.slice_lora_b
    if len(layer.lora_a_stacked) > 1:
        parts: list[torch.Tensor | None] = [None] * len(layer.lora_a_stacked)
        parts[sub] = idx
        return fn(parts)[sub]
    return fn(idx)


class LoRASlots:
    """The adapters weightsync syncs into one vLLM worker's LoRA slots (see the module docstring)."""

    def __init__(self, worker: Any) -> None:
        self.manager = _manager(worker)
        self.adapters: dict[int, _Adapter] = {}

    # ---- init: resolve and check, nothing written -------------------------------------------
    def _locate(self, name: str) -> tuple[str, str, int] | None:
        from vllm.lora.utils import parse_fine_tuned_lora_name

        mapper = getattr(self.manager.model, "hf_to_vllm_mapper", None)
        mapper = mapper.get_rename_mapper() if hasattr(mapper, "get_rename_mapper") else mapper
        module, is_a = parse_fine_tuned_lora_name(name, mapper)
        which = "a" if is_a else "b"
        if module in self.manager.modules:
            return module, which, 0
        for parent, subs in self.manager.packed_modules.items():
            if module in subs and parent in self.manager.modules:
                return parent, which, subs.index(module)
        if on_other_stage(self.manager.model, module):
            return None  # another pipeline stage's layer: that stage's worker takes it
        raise ValueError(f"target_modules: adapter tensor {name!r} targets {module!r}, which has no LoRA layer in "
                         f"this engine (its LoRA layers: {_short(sorted(self.manager.modules))}; the engine's "
                         f"LoRA config or the model's supported modules lack it)")

    def plan(self, adapter_id: int, config: dict[str, Any],
             metas: list[tuple[str, tuple[int, ...]]]) -> list[LoRABlock]:
        """Resolve an adapter's tensors (``(name, full shape)``) to this worker's blocks; refuse bad
        input naming the field. Registers nothing until the first :meth:`commit`."""
        from vllm.lora.peft_helper import PEFTHelper

        lcfg = self.manager.lora_config
        if not isinstance(adapter_id, int) or isinstance(adapter_id, bool) or adapter_id < 1:
            raise ValueError(f"adapter_id must be an int >= 1, got {adapter_id!r}")
        theirs = set(self.manager.list_adapters()) - set(self.adapters)
        if adapter_id in theirs:
            raise ValueError(f"adapter_id {adapter_id}: vLLM already serves an adapter with this id that weightsync "
                             f"did not sync (loaded from a directory); pick another id")
        others = [a for a in self.adapters if a != adapter_id]
        if len(others) + 2 > lcfg.max_loras:
            raise ValueError(f"max_loras: adapter_id {adapter_id} has no slot: {len(others) + 1} adapter(s) need "
                             f"{len(others) + 2} slots (one each plus one to stage a sync into) and the engine has "
                             f"max_loras={lcfg.max_loras}")
        try:
            helper = PEFTHelper.from_dict(dict(config))
            helper.validate_legal(lcfg)
        except ValueError as e:
            raise ValueError(f"r: {e} (adapter_id {adapter_id})") from None
        blocks: list[LoRABlock] = []
        scaling: dict[str, float] = {}
        for name, shape in metas:
            blocks += self._tensor_blocks(name, tuple(shape), helper, scaling)
        self.adapters.setdefault(adapter_id, _Adapter(adapter_id, {}, (), {}))
        a = self.adapters[adapter_id]
        a.config, a.blocks, a.scaling = dict(config), tuple(blocks), scaling
        return blocks

    def _tensor_blocks(self, name: str, shape: tuple[int, ...], helper: Any,
                       scaling: dict[str, float]) -> list[LoRABlock]:
        from vllm.lora.utils import parse_fine_tuned_lora_name

        located = self._locate(name)
        if located is None:
            return []
        module, which, sub = located
        layer = self.manager.modules[module]
        peft_module, _ = parse_fine_tuned_lora_name(name)
        rank, scale = helper.get_rank_and_scaling(peft_module)
        if which == "b":
            scaling[name] = scale
        if _is_embedding(layer):
            return [self._embedding_block(name, shape, module, which, rank, layer)]
        if not isinstance(getattr(layer, "lora_a_stacked", None), tuple) or not hasattr(layer, "output_slices"):
            raise ValueError(f"target_modules: adapter tensor {name!r} targets {module!r}, a "
                             f"{type(layer).__name__}: weightsync syncs LoRA on linear and embedding layers only")
        if len(shape) != 2 or (shape[0] if which == "a" else shape[1]) != rank:
            want = f"({rank}, in)" if which == "a" else f"(out, {rank})"
            raise ValueError(f"r: adapter tensor {name!r} has shape {shape}, expected {want} for rank r={rank}")
        idx = _sliced(layer, which, sub, torch.arange(shape[0] * shape[1]).view(shape))
        stacked = (layer.lora_a_stacked if which == "a" else layer.lora_b_stacked)[sub]
        want = (rank, stacked.shape[3]) if which == "a" else (
            layer.output_slices[sub] if len(layer.output_slices) > sub else stacked.shape[2], rank)
        if tuple(idx.shape) != want:
            raise ValueError(f"target_modules: adapter tensor {name!r} of shape {shape} gives this TP rank a "
                             f"{tuple(idx.shape)} block, but vLLM's layer {module!r} holds {want}")
        return [LoRABlock(name, reg, module, which, sub, at) for reg, at in _blocks(idx, shape[1])]

    @staticmethod
    def _embedding_block(name: str, shape: tuple[int, ...], module: str, which: str, rank: int,
                         layer: Any) -> LoRABlock:
        """An embedding's ``lora_embedding_A`` (``(r, vocab)``, held transposed in the slot) or
        ``lora_embedding_B`` (``(dim, r)``): whole on every TP rank, as vLLM's ``set_lora`` writes them."""
        vocab, dim = layer.lora_a_stacked.shape[1], layer.lora_b_stacked.shape[2]
        want = (rank, vocab) if which == "a" else (dim, rank)
        if tuple(shape) != want:
            field = "r" if (shape[0] if which == "a" else shape[-1]) != rank else "target_modules"
            raise ValueError(f"{field}: adapter tensor {name!r} has shape {tuple(shape)}, but vLLM's embedding "
                             f"layer {module!r} takes {want} (rank r={rank}, its vocabulary and hidden size)")
        return LoRABlock(name, Region.full(tuple(shape)), module, which, 0, (0, 0), transposed=which == "a")

    # ---- a sync: stage, then commit or discard -----------------------------------------------
    def _free_slot(self, adapter_id: int) -> int:
        taken = {a.staged for a in self.adapters.values()} | {a.slot for a in self.adapters.values()}
        for i, owner in enumerate(self.manager.lora_index_to_id):
            if owner is None and i not in taken:
                return i
        raise ValueError(f"max_loras: no free LoRA slot to stage adapter_id {adapter_id} into "
                         f"(slots: {list(self.manager.lora_index_to_id)})")

    def dests(self, adapter_id: int) -> list[DestPiece]:
        """The adapter's blocks on this worker as the reshard plan's destinations."""
        return [DestPiece(b.name, b.region, b.param, b.at) for b in self._adapter(adapter_id).blocks]

    @property
    def device(self) -> torch.device:
        """Where the slots are (the data plane's device on this worker)."""
        stacked = next(iter(self.manager.modules.values())).lora_a_stacked
        return (stacked if isinstance(stacked, torch.Tensor) else stacked[0]).device

    def begin(self, adapter_id: int) -> dict[str, torch.Tensor]:
        """Stage a sync of ``adapter_id``: a free slot, zeroed (as vLLM's activation: what the adapter lacks is
        zero); its matrices by param (:meth:`dests`), for the received blocks. The serving slot is untouched."""
        a = self._adapter(adapter_id)
        self.discard(adapter_id)
        a.staged = self._free_slot(adapter_id)
        for module in self.manager.modules.values():
            module.reset_lora(a.staged)
        return self._matrices(a)

    def end(self, adapter_id: int, received: int) -> int:
        """The staged slot received every block (``received`` bytes): fold the scaling into B, as vLLM's
        ``LoRALayerWeights.optimize`` (in the slot's dtype); ready to :meth:`commit`."""
        a = self._adapter(adapter_id)
        if a.staged is None:
            raise ValueError(f"adapter_id {adapter_id}: nothing staged")
        matrices = self._matrices(a)
        for b in a.blocks:
            scale = a.scaling.get(b.name, 1)
            if b.which == "b" and scale != 1:
                matrices[b.param][Region(b.at, b.region.sizes).slices()] *= scale
        a.received = received
        return received

    def _matrices(self, a: _Adapter) -> dict[str, torch.Tensor]:
        """The 2-D matrices of the staged slot that ``a``'s blocks land in (views), by param: laid out as
        the adapter's tensors are (an embedding's A transposed back to ``[r, vocab]``)."""
        out: dict[str, torch.Tensor] = {}
        for b in a.blocks:
            layer = self.manager.modules[b.module]
            stacked = layer.lora_a_stacked if b.which == "a" else layer.lora_b_stacked
            if _is_embedding(layer):  # one tensor, no fused slices: A ``[slot, vocab, r]``, B ``[slot, 1, dim, r]``
                out[b.param] = stacked[a.staged].t() if b.transposed else stacked[a.staged, 0]
            else:
                out[b.param] = stacked[b.sub][a.staged, 0]
        return out

    def commit(self, adapter_id: int, version: int) -> None:
        """Serve ``adapter_id`` from its staged slot; the slot that served it is freed."""
        from vllm.lora.lora_model import LoRAModel

        a = self._adapter(adapter_id)
        m = self.manager
        if a.staged is None or m.lora_index_to_id[a.staged] is not None:
            raise ValueError(f"adapter_id {adapter_id}: nothing staged to commit")
        m.lora_index_to_id[a.staged] = adapter_id
        if a.slot is not None and m.lora_index_to_id[a.slot] == adapter_id:
            m.lora_index_to_id[a.slot] = None
        a.slot, a.staged, a.version = a.staged, None, version
        if adapter_id not in m.list_adapters():
            m._registered_adapters[adapter_id] = LoRAModel(adapter_id, int(a.config["r"]), {})
        if adapter_id not in m._active_adapters:
            m._active_adapters[adapter_id] = None
        m.pin_adapter(adapter_id)

    def discard(self, adapter_id: int) -> None:
        """Drop a staged, uncommitted slot (zeroed, free again); the serving slot is untouched."""
        a = self._adapter(adapter_id)
        if a.staged is not None:
            for module in self.manager.modules.values():
                module.reset_lora(a.staged)
            a.staged = None

    def _adapter(self, adapter_id: int) -> _Adapter:
        if adapter_id not in self.adapters:
            raise ValueError(f"adapter_id {adapter_id} was not planned on this worker (call plan first)")
        return self.adapters[adapter_id]

    def state(self) -> dict[int, dict[str, Any]]:
        return {i: {"slot": a.slot, "version": a.version, "received": a.received} for i, a in self.adapters.items()}

    def slot_tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """Every LoRA layer's stacked tensors at ``slot`` (copies), ``<module>.lora_a.<i>`` / ``.lora_b.<i>``."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in self.manager.modules.items():
            for w in ("a", "b"):
                stacked = getattr(layer, f"lora_{w}_stacked", ())
                for i, t in enumerate((stacked,) if isinstance(stacked, torch.Tensor) else stacked):
                    out[f"{name}.lora_{w}.{i}"] = t[slot].clone()
        return out


def _is_embedding(layer: Any) -> bool:
    """vLLM's embedding LoRA layer (``VocabParallelEmbeddingWithLoRA``): one ``[slots, vocab, r]`` A."""
    return isinstance(getattr(layer, "lora_a_stacked", None), torch.Tensor) and layer.lora_a_stacked.dim() == 3


def lora_slots(worker: Any) -> LoRASlots:
    """The worker's :class:`LoRASlots`, created on first use."""
    slots = getattr(worker, "_weightsync_lora", None)
    if slots is None:
        slots = LoRASlots(worker)
        worker._weightsync_lora = slots
    return slots


def _short(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def base_fingerprints(model: torch.nn.Module, wanted: list[list[Any]]) -> dict[str, list[Any]]:
    """For the trainer's base tensors ``wanted`` (``[vLLM name, full shape]``, 1-D) that this worker
    holds whole under that name (``.base_layer`` dropped): name -> ``[dtype, fingerprint]`` of its live
    values (:mod:`weightsync.fingerprint`); the trainer compares them with its own (``LoRASync``)."""
    live = {n.replace(".base_layer.", "."): p for n, p in model.named_parameters()}
    out: dict[str, list[Any]] = {}
    for name, shape in wanted:
        p = live.get(name)
        if p is not None and list(p.shape) == list(shape) and p.dim() == 1:
            out[name] = [dtype_name(p.dtype), fingerprint(p.data, (0,), tuple(p.shape), p.dtype)]
    return out
