"""Fingerprints of a tensor's values that its shards add up to (a LoRA sync checks with them that an
engine's base weights are the trainer's, without gathering the trainer's shards or sending weights).

``fingerprint(values, offsets, shape, dtype)`` of a region of a tensor (``values`` at ``offsets`` of
a tensor of full ``shape``) is the sum over its elements of ``bits * w(i)`` modulo 2**64:
``bits`` the element's bit pattern in ``dtype``, ``i`` its flat index in the full tensor, ``w`` an odd
mix of it. The fingerprints of disjoint regions add up (modulo 2**64, as int64 sums wrap) to the whole
tensor's however it is cut, and one element that differs always changes it. Not a cryptographic hash:
it tells apart weights that were not made equal on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["fingerprint"]

_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 (the golden ratio's bits) as an int64
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(values: torch.Tensor, offsets: Sequence[int], shape: Sequence[int], dtype: torch.dtype) -> int:
    """The fingerprint (a signed int64) of ``values``, the region at ``offsets`` of a tensor of full
    ``shape``, compared in ``dtype`` (see the module docstring)."""
    if len(offsets) != values.dim() or len(shape) != values.dim():
        raise ValueError(f"offsets {tuple(offsets)} and shape {tuple(shape)} must have the values' "
                         f"{values.dim()} dims")
    v = values.detach().to(device="cpu", dtype=dtype).contiguous()
    bits = v.view(_BITS[dtype.itemsize]).to(torch.int64)
    index = torch.zeros(v.shape, dtype=torch.int64)
    stride = 1
    for d in reversed(range(v.dim())):
        at = [1] * v.dim()
        at[d] = v.shape[d]
        index += ((torch.arange(v.shape[d], dtype=torch.int64) + int(offsets[d])) * stride).view(at)
        stride *= int(shape[d])
    w = index * _MIX
    w = (w ^ (w >> 29)) | 1
    return int((bits * w).sum())
