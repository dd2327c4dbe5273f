"""Block-FP8 targets: the worker quantizes the trainer's bf16/fp32 shard as the checkpoint format does.

vLLM's block-FP8 layers (``quantization_config`` ``quant_method: fp8`` with ``weight_block_size``,
the layout of the Qwen3-*-FP8 and DeepSeek-V3 checkpoints) hold ``weight`` in ``float8_e4m3fn`` and,
per ``weight_block_size`` block (128 x 128), ``weight_scale_inv`` in float32: the multiplier that
dequantizes the block (``weight ~= fp8 * weight_scale_inv``). Trainers hold the unquantized
weights. Here (mode (a) of issue 38) each worker receives exactly its shard of the trainer's tensor,
in the trainer's dtype, into a float32 staging tensor shaped as the layer's checkpoint-layout
``weight``, and quantizes it block by block before vLLM's own processing runs on the result
(``LayerwiseApplier.finish``). That equals quantizing the full tensor, then sharding, as long as no
TP shard cuts a block: every piece must start on a block boundary in the trainer's tensor and in the
parameter, and end on one or at the tensor's edge (:func:`check_blocks`, refused naming the
parameter otherwise). vLLM requires the same of its TP shards.

The quantizer (:func:`quantize_blocks`) is the checkpoint format's reference: per block,
``amax = max |x|`` (float32), ``scale_inv = amax / 448`` (1.0 for an all-zero block), ``fp8 =
clamp(x / scale_inv, -448, 448)`` cast to e4m3 (round to nearest even).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["FP8_MAX", "QUANTIZABLE", "block_size", "scale_name", "check_blocks", "check_sent_dtype", "kv_cache_scale",
           "refuse_full_tensors",
           "quantize_blocks", "quantize_into"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value."""
QUANTIZABLE = ("bfloat16", "float16", "float32")
"""Trainer dtypes the workers quantize (float32 holds each of them exactly)."""
STAGING_DTYPE = torch.float32

_FP8_METHODS = ("Fp8LinearMethod", "Fp8MoEMethod")
_WEIGHTS = {"weight": "weight_scale_inv", "w13_weight": "w13_weight_scale_inv", "w2_weight": "w2_weight_scale_inv"}
"""Block-FP8 weights and their scales: a linear layer's, a fused-MoE layer's (``Fp8MoEMethod``: experts
``[E, rows, cols]``, scales ``[E, rows / 128, cols / 128]``, each expert quantized on its own)."""


def _scales(module: Any) -> list[str]:
    """The block-scale attributes a block-FP8 ``module`` must hold."""
    moe = type(module.quant_method).__name__ == "Fp8MoEMethod"
    return ["w13_weight_scale_inv", "w2_weight_scale_inv"] if moe else ["weight_scale_inv"]


def scale_name(attr: str) -> str | None:
    """The block-scale attribute of weight attribute ``attr`` (None: not a quantized weight)."""
    return _WEIGHTS.get(attr)


def block_size(module: Any, param_name: str) -> tuple[int, int] | None:
    """``(rows, cols)`` of the FP8 blocks of ``module``'s weights, None for a layer that is not FP8.
    Raises ``ValueError`` naming ``param_name`` for an FP8 layer weightsync cannot quantize into:
    per-tensor or per-channel scales (no ``weight_block_size``), or a layer without the block scales
    (``weight_scale_inv``) in its checkpoint layout."""
    qm = getattr(module, "quant_method", None)
    if qm is None or type(qm).__name__ not in _FP8_METHODS:
        return None
    block = getattr(qm, "weight_block_size", None)
    if block is None:
        raise ValueError(f"parameter {param_name!r}: vLLM's layer is FP8 with per-tensor scales (no "
                         "weight_block_size); weightsync quantizes into block-FP8 layers only")
    if not all(isinstance(getattr(module, s, None), torch.Tensor) for s in _scales(module)):
        raise ValueError(f"parameter {param_name!r}: vLLM's block-FP8 layer has no weight_scale_inv (missing "
                         "scales; e8m0 or per-tensor scales are not supported)")
    if getattr(qm, "is_scale_e8m0", False):
        raise ValueError(f"parameter {param_name!r}: vLLM's layer stores e8m0 block scales; weightsync "
                         "quantizes into float32 weight_scale_inv only")
    rows, cols = (int(b) for b in block)
    return rows, cols


def kv_cache_scale(module: Any, attr: str) -> bool:
    """Whether ``module.attr`` is an attention layer's FP8 KV-cache scale (``k_scale``, ``v_scale``, ...),
    which a quantized model's layers hold and a checkpoint may or may not carry (``kv_cache_scheme``)."""
    qm = getattr(module, "quant_method", None)
    return qm is not None and type(qm).__name__.endswith("KVCacheMethod") and attr.endswith("_scale")


def refuse_full_tensors(dests: Any, transport: str, instead: list[str]) -> None:
    """Full-tensor transports hand whole tensors to vLLM's loaders, which would cast the trainer's
    weights into FP8 instead of quantizing them: refused at init, naming the first such tensor."""
    quantized = set(getattr(dests, "quantized", ()))
    hit = next((p for p in dests.placed if p.param in quantized), None)
    if hit is not None:
        raise ValueError(f"parameter {hit.name!r}: vLLM's {hit.param} is block FP8, which {transport} cannot fill "
                         f"(its loaders would cast, not quantize); use one whose workers quantize: "
                         f"{', '.join(instead)}")


def check_sent_dtype(name: str, dtype: str, param: str) -> None:
    """A trainer tensor into an FP8 weight must be one the workers quantize exactly."""
    if dtype not in QUANTIZABLE:
        raise ValueError(f"parameter {name!r}: the trainer sends {dtype}, which cannot be quantized into vLLM's "
                         f"block-FP8 {param} (send one of {', '.join(QUANTIZABLE)})")


def check_blocks(name: str, shape: Sequence[int], param_shape: Sequence[int], block: tuple[int, int],
                 pieces: Iterable[Any]) -> None:
    """Every piece of trainer tensor ``name`` (global ``shape``) into an FP8 weight of ``param_shape``
    covers whole ``block``s of both (the last two dims): a block of the parameter is then a block
    of the trainer's tensor, so the shard quantizes as the full tensor does. ``ValueError`` naming
    the parameter otherwise."""
    for p in pieces:
        for d, b in zip((-2, -1), block):
            start, size, at = p.region.offsets[d], p.region.sizes[d], p.param_offsets[d]
            ends = (start + size == shape[d] and at + size == param_shape[d]) or size % b == 0
            if start % b or at % b or not ends:
                raise ValueError(f"parameter {name!r}: this worker's shard (rows/cols {tuple(p.region.offsets)}"
                                 f"+{tuple(p.region.sizes)} at {tuple(p.param_offsets)} of {p.param}) cuts vLLM's "
                                 f"FP8 blocks of {block[0]} x {block[1]} (weight_block_size) along dim "
                                 f"{len(shape) + d}; TP shards must hold whole blocks")


@torch.no_grad()
def quantize_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, scale_inv)`` of ``x`` (``[..., rows, cols]``) per ``block`` of its last two dims: the
    reference quantizer of the module docstring; partial blocks at the edges take their own amax."""
    bn, bk = block
    *lead, rows, cols = x.shape
    nb, kb = -(-rows // bn), -(-cols // bk)
    padded = torch.nn.functional.pad(x.to(STAGING_DTYPE), (0, kb * bk - cols, 0, nb * bn - rows))
    blocks = padded.reshape(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = amax / FP8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (blocks / scale.unsqueeze(-1).unsqueeze(-3)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, nb * bn, kb * bk)[..., :rows, :cols]
    return q.contiguous(), scale.contiguous()


@torch.no_grad()
def quantize_into(layer: torch.nn.Module, staged: dict[str, torch.Tensor], block: tuple[int, int],
                  boxes: Mapping[str, Sequence[Any]] | None = None) -> None:
    """Quantize each staged weight (attribute -> float tensor in the checkpoint layout's shape) into
    ``layer``'s checkpoint-layout FP8 weight and its block scales; with ``boxes`` (attribute ->
    block-aligned ``Region`` s), only those boxes (the rest arrived quantized: FP8 on the wire)."""
    for attr, x in staged.items():
        weight, scales = getattr(layer, attr), getattr(layer, scale_name(attr))
        want = tuple(-(-n // b) for n, b in zip(x.shape[-2:], block))
        if weight.shape != x.shape or tuple(scales.shape[-2:]) != want:
            raise RuntimeError(f"{type(layer).__name__}.{attr}: FP8 layout {tuple(weight.shape)} / "
                               f"{tuple(scales.shape)} is not the quantized {tuple(x.shape)} / {want}")
        for box in ([None] if boxes is None else boxes.get(attr, ())):
            at = (...,) if box is None else box.slices()
            q, scale = quantize_blocks(x[at], block)
            weight.data[at] = q
            scales.data[(...,) if box is None else _block_slices(box, block)] = scale.to(scales.dtype)


def _block_slices(box: Any, block: tuple[int, int]) -> tuple[slice, ...]:
    """The block scales' slices of a block-aligned ``box`` of a weight (2-D, or 3-D experts)."""
    full = (1,) * (len(box.offsets) - len(block)) + tuple(block)  # experts: one block per expert on dim 0
    return tuple(slice(o // b, -(-(o + s) // b)) for o, s, b in zip(box.offsets, box.sizes, full))
