"""What ``RayVLLMWeightSyncClient`` runs inside vLLM ``LLM`` Ray actors (``__ray_call__``), and how a
failed call on one reads on trainer rank 0.

A call that reaches vLLM's engine core (every weight-transfer call, pausing) waits in vLLM's client
for the core's answer. When the core process dies, vLLM's monitor thread marks the engine dead, so
every later call raises ``EngineDeadError`` at once; but a call sent before the monitor noticed waits
on its answer forever (the monitor fails no pending call). :func:`watched` runs the call in a thread
and raises ``EngineDeadError`` as soon as the engine is marked dead, so a core that dies under a sync
fails it at once, as :class:`~weightsync.errors.EngineDead`, instead of at ``timeout_s``.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import EngineDead, RemoteCallError

__all__ = ["watched", "call_method", "is_llm", "set_partial", "get_partial", "llm_pause", "llm_resume",
           "llm_is_paused", "llm_release", "stop_engine_core", "remote_call_error"]

POLL_S = 0.05
"""How often a watched call looks whether the engine core was marked dead."""

_PARTIAL = "_weightsync_partly_applied"


def _resources(actor: Any) -> Any:
    """vLLM's engine-core client resources of an ``LLM`` (``engine_dead``), or None (another actor,
    or an engine core in the actor's own process)."""
    core = getattr(getattr(actor, "llm_engine", None), "engine_core", None)
    resources = getattr(core, "resources", None)
    return resources if hasattr(resources, "engine_dead") else None


def is_llm(actor: Any) -> bool:
    """Whether the actor is vLLM's ``LLM`` with its engine core in another process (its calls are watched)."""
    return _resources(actor) is not None


def watched(actor: Any, fn: Any, *args: Any) -> Any:
    """``fn(actor, *args)``; on an ``LLM`` whose engine core is marked dead while it runs, vLLM's
    ``EngineDeadError`` within ``POLL_S`` (the call's thread is left waiting: the engine must restart)."""
    resources = _resources(actor)
    if resources is None:
        return fn(actor, *args)
    finished, box = threading.Event(), {}

    def run() -> None:
        try:
            box["value"] = fn(actor, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
        finally:
            finished.set()

    threading.Thread(target=run, name="weightsync-watched-call", daemon=True).start()
    while not finished.wait(POLL_S):
        if resources.engine_dead:
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError()
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_method(actor: Any, method: str, *args: Any) -> Any:
    return getattr(actor, method)(*args)


def set_partial(actor: Any, reason: str | None) -> None:
    setattr(actor, _PARTIAL, reason)


def get_partial(actor: Any) -> str | None:
    return getattr(actor, _PARTIAL, None)


def _utility(llm: Any, method: str, *args: Any) -> Any:
    core = llm.llm_engine.engine_core
    if hasattr(core, "call_utility"):  # the engine core in its own process (vLLM's default)
        return core.call_utility(method, *args)
    return getattr(core.engine_core, method)(*args)  # in-process engine core


def llm_pause(llm: Any, mode: str, clear_cache: bool) -> None:
    """What ``AsyncLLM.pause_generation`` does, for ``LLM``: the scheduler paused in the engine core."""
    renderer = getattr(llm.llm_engine, "renderer", None)
    if clear_cache and renderer is not None and hasattr(renderer, "clear_mm_cache"):
        renderer.clear_mm_cache()
    _utility(llm, "pause_scheduler", mode, clear_cache)


def llm_resume(llm: Any) -> None:
    _utility(llm, "resume_scheduler")


def llm_is_paused(llm: Any) -> bool:
    return bool(_utility(llm, "is_scheduler_paused"))


def llm_release(llm: Any) -> None:
    """What ``AsyncLLM.shutdown_weight_transfer_engine`` does, for ``LLM`` (which has no such method):
    every worker releases its trainer connection (vLLM's worker method of that name)."""
    llm.collective_rpc("shutdown_weight_transfer_engine")


def stop_engine_core(llm: Any, timeout_s: float) -> None:
    """Inside an ``LLM`` actor: vLLM's own engine-core shutdown (processes joined, queues unlinked)."""
    llm.llm_engine.engine_core.shutdown(timeout=timeout_s)


# --- on trainer rank 0 ---
def remote_call_error(method: str, error: BaseException) -> RemoteCallError:
    """What a failed call on an ``LLM`` actor raises: the remote exception and where it was raised,
    without the actor's repr Ray adds (``LLM``'s prints the whole model); ``EngineDead`` when vLLM's
    engine core died (the actor lives, every later call fails the same way) or the actor is dead (Ray's
    ``ActorDiedError``: its ``LLM(...)`` raised, e.g. an engine that cannot start on this machine, or
    its process died), naming the cause."""
    if type(error).__name__ == "ActorDiedError":  # the actor died, or its LLM(...) raised: nothing will answer
        return EngineDead(f"{method} failed: the inference actor is dead ({_death_cause(error)}): restart the "
                          "engine, then trainer_init")
    cause = getattr(error, "cause", None)
    if not isinstance(cause, BaseException):
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return RemoteCallError(f"{method} failed on an inference actor: {type(error).__name__}: {first[:500]}")
    chain = [cause]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(nxt)
    where = _innermost_frame(getattr(error, "traceback_str", "") or "")
    if any(type(c).__name__ == "EngineDeadError" for c in chain):
        return EngineDead(f"{method} failed on an inference actor: vLLM's engine core is dead ({type(cause).__name__}: "
                          f"{cause}); the actor is alive, but every call fails until the engine restarts: restart the "
                          "engine, then trainer_init")
    return RemoteCallError(f"{method} failed on an inference actor: {type(cause).__name__}: {cause}{where}")


def _death_cause(error: BaseException) -> str:
    """Why an actor died, from Ray's ``ActorDiedError``: the error its creation raised (the last line
    of that traceback: ``Type: message``), or the reason Ray gives for a process that died."""
    text = str(error).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if getattr(error, "actor_init_failed", False) and lines:
        return f"its creation failed: {lines[-1][:1000]}"
    return " ".join(ln for ln in lines if not ln.startswith(("class_name:", "actor_id:", "pid:", "namespace:",
                                                            "ip:", "name:")))[:1000] or type(error).__name__


def _innermost_frame(traceback_str: str) -> str:
    """`` (at File "...", line N, in f)``: the last frame of a remote traceback, or nothing."""
    frames = [ln.strip() for ln in traceback_str.splitlines() if ln.strip().startswith("File ")]
    return f" (at {frames[-1]})" if frames else ""
