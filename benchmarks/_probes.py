"""Functions ``transfer_throughput.py`` runs inside the local cluster's trainer and receiver processes.

Called by name (``"_probes:<function>"``) through ``weightsync.testing.actors``; the benchmarks
folder reaches the processes' ``sys.path`` because they are spawned from the benchmark script.

* memory: ``mem_reset`` (gc, ``malloc_trim``, reset the peak RSS via ``/proc/self/clear_refs``),
  ``mem_peak`` (``VmHWM``/``VmRSS``);
* phase timers: ``instrument`` wraps the live engine's communicator waits and worker methods;
* baselines: the naive sync (``full_tensor()`` per parameter on every trainer rank, trainer rank 0
  broadcasts it over a gloo group to every worker, each worker calls ``load_weights``), raw gloo
  point-to-point bandwidth, and memcpy.
"""

from __future__ import annotations

import ctypes
import gc
import json
import time
from collections import defaultdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from weightsync.testing.actors import STATE

__all__ = [
    "instrument",
    "mem_peak",
    "mem_reset",
    "memcpy",
    "model_bytes",
    "naive_recv",
    "naive_send",
    "naive_setup",
    "naive_teardown",
    "p2p_plan",
    "p2p_run",
    "plan_pair_bytes",
    "p2p_setup",
    "p2p_teardown",
    "profile_start",
    "profile_stop",
    "timers",
    "touch_params",
]

_TIMEOUT = timedelta(seconds=300)


# --- memory -------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def mem_reset() -> int:
    """Return freed heap to the OS, reset the peak RSS to the current RSS; returns RSS bytes."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the baseline may then include reusable free memory
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to VmRSS
    return _status_kib("VmRSS") * 1024


def mem_peak() -> dict[str, int]:
    """Peak RSS since the last ``mem_reset`` and the RSS now, in bytes."""
    return {"hwm": _status_kib("VmHWM") * 1024, "rss": _status_kib("VmRSS") * 1024}


def model_bytes() -> int:
    """Bytes of the trainer's full (unsharded) parameters: what a broadcast moves to each worker."""
    return sum(p.numel() * p.element_size() for p in STATE["model"].parameters())


# --- phase timers on the live engine --------------------------------------------------------
def _timed(obj: Any, name: str, key: str) -> None:
    fn = getattr(obj, name)
    fn = getattr(fn, "probe_original", fn)  # an engine kept between runs is wrapped once, not twice
    acc = STATE.setdefault("probe_timers", defaultdict(float))

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0

    wrapper.probe_original = fn  # type: ignore[attr-defined]
    setattr(obj, name, wrapper)  # instance attribute: the class is untouched


def instrument() -> None:
    """Time the engine's data-plane waits (``wire``) and, on workers, each engine method.
    Call after the engine's init (its data plane is joined then)."""
    engine = STATE.get("engine")
    plane = getattr(getattr(engine, "comm", None), "plane", None)  # the data plane joined (None: control only)
    if plane is not None:
        for name in ("exchange", "wait", "broadcast"):
            if hasattr(plane, name):
                _timed(plane, name, "wire")
    if engine is not None and hasattr(engine, "send_weights"):
        _timed(engine, "send_weights", "send")
    if engine is not None and hasattr(engine, "receive_weights"):
        for name, key in (("start_weight_update", "start"), ("receive_weights", "receive"),
                          ("finish_weight_update", "finish")):
            _timed(engine, name, key)


def timers() -> dict[str, float]:
    """Seconds accumulated since the previous call (and reset them); ``cpu``: this process's CPU
    seconds (all threads) since the previous call."""
    acc = STATE.setdefault("probe_timers", defaultdict(float))
    out = dict(acc)
    acc.clear()
    now = time.process_time()
    out["cpu"] = now - STATE.get("probe_cpu", now)
    STATE["probe_cpu"] = now
    return out


# --- naive baseline: full_tensor() + broadcast + load_weights --------------------------------
def _group(host: str, port: int, rank: int, world: int, prefix: str) -> tuple[Any, Any]:
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=_TIMEOUT, wait_for_workers=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, _TIMEOUT)
    return store, pg


def naive_setup(host: str, port: int, world: int, rank: int | None = None) -> None:
    """Trainers: rank 0 hosts the group (data rank 0) and publishes the tensor list; other trainer
    ranks only take part in the gathers. Workers: pass their data rank (1..world-1)."""
    if rank is None:  # a trainer
        if STATE["rank"] != 0:
            STATE["naive"] = None
            return
        store, pg = _group(host, port, 0, world, "naive/")
        metas = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in STATE["model"].named_parameters()]
        store.set("metas", json.dumps(metas))
        STATE["naive"] = (store, pg, metas)
        return
    store, pg = _group(host, port, rank, world, "naive/")
    store.wait(["metas"], _TIMEOUT)
    STATE["naive"] = (store, pg, json.loads(store.get("metas")))


def _broadcast(pg: Any, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([t.view(-1).view(torch.uint8)], opts).wait()  # bytes: any dtype over gloo


@torch.no_grad()
def naive_send() -> None:
    """Every trainer rank (collective): gather each parameter; rank 0 broadcasts it whole."""
    naive = STATE["naive"]
    for _, p in STATE["model"].named_parameters():
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        if naive is not None:
            _broadcast(naive[1], t.contiguous())
        del t


@torch.no_grad()
def naive_recv() -> None:
    """Every worker: receive each tensor into a fresh buffer and hand it to vLLM's ``load_weights``."""
    from vllm.config import set_current_vllm_config

    _, pg, metas = STATE["naive"]
    model = STATE["model"]
    with set_current_vllm_config(STATE["vllm_config"]):
        for name, dtype, shape in metas:
            buf = torch.empty(shape, dtype=getattr(torch, dtype))
            _broadcast(pg, buf)
            model.load_weights([(name, buf)])


def touch_params() -> None:
    """Write every vLLM parameter once (``add_(0)``), so pages vLLM allocated but never wrote are
    resident before the memory baseline (else the first sync's writes would count as extra memory)."""
    with torch.no_grad():
        for p in STATE["model"].parameters():
            p.data.add_(0)


def profile_start() -> None:
    """cProfile this process's main thread (where the actor runs calls) until ``profile_stop``."""
    import cProfile

    STATE["probe_profile"] = cProfile.Profile()
    STATE["probe_profile"].enable()


def profile_stop(top: int = 25) -> str:
    """The profile since ``profile_start``: the ``top`` functions by cumulative and by own time."""
    import io
    import pstats

    prof = STATE.pop("probe_profile")
    prof.disable()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out).strip_dirs()
    st.sort_stats("cumulative").print_stats(top)
    st.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def naive_teardown() -> None:
    STATE.pop("naive", None)


# --- raw gloo point-to-point ------------------------------------------------------------
def p2p_setup(host: str, port: int, rank: int, world: int) -> None:
    """Join a gloo group of every trainer (ranks 0..T-1) and worker (T..T+W-1), as the M2N data group."""
    STATE["p2p"] = _group(host, port, rank, world, "p2p/")[1]


def _p2p_steps(sends: dict[int, int], recvs: dict[int, int], iters: int) -> tuple[float, float]:
    """Seconds and this process's CPU seconds (all threads) of ``iters`` steps after one untimed
    warm-up; in each this rank posts one send of ``sends[p]`` bytes to every peer ``p`` and one receive
    of ``recvs[p]`` bytes from every peer, all at once, from and into ready buffers (pages touched
    beforehand), then waits for all."""
    pg = STATE["p2p"]
    bufs = {("s", p): torch.ones(n, dtype=torch.uint8) for p, n in sends.items()}
    bufs |= {("r", p): torch.zeros(n, dtype=torch.uint8) for p, n in recvs.items()}

    def step(tag: int) -> None:
        works = [pg.send([bufs["s", p]], p, tag) for p in sends] + [pg.recv([bufs["r", p]], p, tag) for p in recvs]
        for w in works:
            w.wait()

    step(0)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(iters):
        step(i + 1)
    return time.perf_counter() - t0, time.process_time() - c0


def p2p_run(sends: list[int], recvs: list[int], nbytes: int, iters: int) -> dict[str, float]:
    """``iters`` M2N-shaped rounds: one ``nbytes`` message to every rank in ``sends`` and from every
    rank in ``recvs`` per step. Returns seconds and bytes received."""
    seconds, _ = _p2p_steps(dict.fromkeys(sends, nbytes), dict.fromkeys(recvs, nbytes), iters)
    return {"seconds": seconds, "recv_bytes": float(iters * nbytes * len(recvs))}


def plan_pair_bytes() -> dict[int, int]:
    """Bytes the live M2N engine's plan moves between this rank and each peer per sync (a trainer:
    worker rank -> bytes sent; a worker: trainer rank -> bytes received), dense, as its messages carry them."""
    sender = hasattr(STATE["engine"], "send_weights")
    out: dict[int, int] = defaultdict(int)
    for rnd in STATE["engine"].plan.rounds:
        for m in rnd:
            out[m.dst if sender else m.src] += m.nbytes
    return dict(out)


def p2p_plan(sends: dict[int, int], recvs: dict[int, int], iters: int) -> dict[str, float]:
    """The plan's traffic moved raw: every pair's bytes of one sync as one message, no copies, no
    rounds (``sends`` / ``recvs``: peer -> bytes). Seconds, CPU seconds and bytes received, per step."""
    seconds, cpu = _p2p_steps(sends, recvs, iters)
    return {"seconds": seconds / iters, "cpu_s": cpu / iters, "recv_bytes": float(sum(recvs.values()))}



def p2p_teardown() -> None:
    STATE.pop("p2p", None)


# --- memcpy ---------------------------------------------------------------------------
def memcpy(nbytes: int, iters: int) -> dict[str, float]:
    """GB/s of ``copy_`` into an existing buffer and into a fresh allocation (page faults), one thread."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    existing = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(iters):
        fresh = torch.empty(nbytes, dtype=torch.uint8)
        fresh.copy_(src)
        del fresh
    new = time.perf_counter() - t0
    return {"existing_gbps": nbytes * iters / existing / 1e9, "fresh_gbps": nbytes * iters / new / 1e9}
