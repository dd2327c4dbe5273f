"""LoRA sync's outcome on every trainer rank and its bounded waits (issues 56, 57), main tier.

Two FSDP2 trainer ranks (``helpers.ranks``, gloo) sync a PEFT adapter through :class:`LoRASync` into a
stand-in engine of two workers: each worker is ``LoRAWorkerExtension`` (the methods vLLM mixes into its
workers) over a record of what was staged and committed instead of vLLM's slots, called by method
name as vLLM's ``collective_rpc`` calls it. Worker 0 holds the first three quarters of every tensor's
rows, worker 1 the last three quarters (both straddle the trainer shards' boundary). The real engine
is ``tests/engine/test_engine_lora.py``.

* a sync that fails on one rank after the other rank's bytes landed raises the same error on every
  rank, and no worker committed (oracle: every rank's outcome; the workers' record);
* a worker stuck in its receive makes every rank raise within ``timeout_s`` + margin;
* a sync that succeeds returns the same version on every rank, and every worker staged exactly its
  rows of the trainer's tensors (oracle: the full tensors gathered from the FSDP2 shards), having
  received over the reshard core's data plane exactly its rows' bytes (computed from the shapes);
* a worker whose blocks changed after init (its destinations differ from the trainer's plan) fails
  the sync on every rank at the plan digest agreement, before any data moves; nothing commits.
* an engine whose base weights differ from the trainer's (one element of one norm) is refused at init
  on every rank naming that parameter (the stand-in engine's base: the trainer's, gathered).
"""

from __future__ import annotations

import threading
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from weightsync.plan.regions import Region
from weightsync.plan.transfer import DestPiece
from weightsync.transports.lora import LoRAWorkerExtension

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 6.0
MARGIN_S = 12.0
"""What every rank may take beyond ``timeout_s`` to raise (``MARGIN_S`` of the library, twice, and slack)."""


def _rows(shape: tuple[int, ...], worker: int, quarters: int = 3) -> Region:
    """Worker 0's block of a tensor: its first ``quarters`` quarters of rows; worker 1's: its last."""
    n = -(-shape[0] * quarters // 4)
    return Region((0 if worker == 0 else shape[0] - n, 0), (n, *shape[1:]))


class _Slots:
    """Stands in for ``LoRASlots`` (its blocks as the plan's destinations, each into a tensor of its
    own); records what it staged, committed and received."""

    device = torch.device("cpu")

    def __init__(self, worker: int, base: dict[str, torch.Tensor]) -> None:
        self.worker = worker
        self.manager = SimpleNamespace(model=SimpleNamespace(named_parameters=lambda: list(base.items())))
        self.blocks: dict[int, dict[str, Region]] = {}
        self.staged: dict[int, dict[str, torch.Tensor]] = {}
        self.served: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        self.received: list[int] = []

    def plan(self, adapter_id, config, metas, quarters: int = 3):
        self.blocks[adapter_id] = {n: _rows(tuple(s), self.worker, quarters) for n, s in metas}

    def dests(self, adapter_id):
        return [DestPiece(n, r, n, (0,) * r.ndim) for n, r in self.blocks[adapter_id].items()]

    def begin(self, adapter_id):
        self.staged[adapter_id] = {n: torch.full(r.sizes, float("nan")) for n, r in self.blocks[adapter_id].items()}
        return self.staged[adapter_id]

    def end(self, adapter_id, received):
        self.received.append(received)
        return received

    def commit(self, adapter_id, version):
        self.served[adapter_id] = (version, self.staged.pop(adapter_id))

    def discard(self, adapter_id):
        self.staged.pop(adapter_id, None)

    def state(self):
        return {i: {"version": v} for i, (v, _) in self.served.items()}


class _Worker(LoRAWorkerExtension):
    def __init__(self, rank: int, base: dict[str, torch.Tensor], stuck: threading.Event | None = None) -> None:
        self.rank, self.stuck = rank, stuck
        self._weightsync_lora = _Slots(rank, base)

    def weightsync_lora_receive(self, *args):
        if self.stuck is not None:
            self.stuck.wait()  # alive, not answering, never joining the data plane
        return super().weightsync_lora_receive(*args)


class _Engine:
    """``collective_rpc`` as vLLM's: every worker runs the call at once, the replies in rank order. A
    callable (what the code before issue 56 sent) is run as vLLM ran it, with the worker first."""

    def __init__(self, workers: list[_Worker]) -> None:
        self.workers = workers

    def collective_rpc(self, method, timeout=None, args=()):
        out: list = [None] * len(self.workers)

        def run(i: int, w: _Worker) -> None:
            fn = getattr(w, method) if isinstance(method, str) else partial(method, w)
            out[i] = fn(*args)

        threads = [threading.Thread(target=run, args=(i, w), daemon=True) for i, w in enumerate(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


def _model():
    from torch.distributed.fsdp import fully_shard

    from test_lora import _peft

    model = _peft(seed=0)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def sync_outcome(fail_rank: int | None, stuck: bool, replanned: bool = False, other_base: bool = False) -> dict:
    """Run in each rank process: one sync into a two-worker stand-in engine (rank 0 drives it);
    ``fail_rank`` fails before worker 1's bytes; ``stuck``: worker 1 never answers its receive;
    ``replanned``: worker 1's blocks change after init (half its rows, not three quarters);
    ``other_base``: worker 1's base differs from the trainer's in one element of ``model.norm.weight``."""
    import torch.distributed as dist

    from weightsync.trainer.lora import LoRASource, peft_base_name
    from weightsync.transports.lora import LoRASync

    rank = dist.get_rank()
    model = _model()
    base = {peft_base_name(n, "default"): p.full_tensor().detach().clone() for n, p in model.named_parameters()
            if peft_base_name(n, "default") is not None}  # (a collective: every rank gathers)
    changed = {**base, "model.norm.weight": base["model.norm.weight"].clone()}
    changed["model.norm.weight"][5] += 0.5
    release = threading.Event()
    workers = [_Worker(0, base), _Worker(1, changed if other_base else base, release if stuck else None)]
    t0, sync = time.monotonic(), None
    try:
        sync = LoRASync(LoRASource(model, 2, rank=rank), 1, [_Engine(workers)] if rank == 0 else [],
                        timeout_s=TIMEOUT_S)
        if replanned and rank == 0:
            slots = workers[1]._weightsync_lora
            slots.plan(1, {}, [(n, _full_shape(n, model)) for n in slots.blocks[1]], quarters=2)
        out = {"returned": sync.sync(_fail_at=1 if fail_rank == rank else None)}
    except Exception as e:  # noqa: BLE001 - the test reads every rank's outcome
        out = {"raised": f"{type(e).__name__}: {e}"}
    out["seconds"] = time.monotonic() - t0
    release.set()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    if rank == 0:
        out["served"] = [{i: (v, {k: t.clone() for k, t in ts.items()})
                          for i, (v, ts) in w._weightsync_lora.served.items()} for w in workers]
        out["full"] = full
        out["received"] = [w._weightsync_lora.received for w in workers]
        out["shard_bytes"] = sync.worker_bytes() if sync is not None else None
    return out


def _full_shape(name: str, model) -> tuple[int, ...]:
    return next(tuple(p.shape) for n, p in model.named_parameters() if n.replace(".default", "") == name)


def _run(fail_rank, stuck, replanned=False, other_base=False) -> list[dict]:
    pytest.importorskip("peft")
    from helpers import ranks

    procs = ranks()
    procs.init(2)
    return procs.run("test_lora_outcome:sync_outcome", fail_rank, stuck, replanned, other_base)


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failed_sync_raises_the_same_error_on_every_rank_and_nothing_commits(fail_rank):
    out = _run(fail_rank, False)
    raised = [o.get("raised") for o in out]
    assert all(raised), f"a rank returned instead of raising: {[o.get('returned') for o in out]}"
    assert raised[0] == raised[1], raised
    assert "LoRA sync of adapter_id 1 failed, version 0 still serving" in raised[0]
    assert f"trainer rank {fail_rank}" in raised[0] and "injected failure" in raised[0]
    assert out[0]["served"] == [{}, {}]  # no worker serves the failed sync's adapter


def test_a_stuck_worker_makes_every_rank_raise_within_timeout_s():
    out = _run(None, True)
    for rank, o in enumerate(out):
        assert "raised" in o, f"trainer rank {rank} returned {o.get('returned')}"
        assert o["seconds"] < TIMEOUT_S + MARGIN_S, (rank, o["seconds"], o["raised"])
        assert "still serving" in o["raised"] or "timed out" in o["raised"], o["raised"]
    assert out[0]["served"] == [{}, {}]


def test_a_sync_returns_one_version_on_every_rank_and_each_worker_stages_its_rows_through_the_core():
    from weightsync import SyncStats

    out = _run(None, False)
    stats = [o["returned"] for o in out]
    assert all(type(s) is SyncStats for s in stats), stats
    assert [(s.backend, s.rank, s.weight_version) for s in stats] == [("lora", 0, "1"), ("lora", 1, "1")], stats
    assert sum(s.bytes_sent for s in stats) == sum(stats[0].bytes_received_per_worker.values())  # each once
    saved = {n.replace(".default", ""): t for n, t in out[0]["full"].items()}
    for w, served in enumerate(out[0]["served"]):
        version, tensors = served[1]
        assert version == 1
        assert tensors.keys() == saved.keys()
        rows = {n: _rows(tuple(t.shape), w) for n, t in saved.items()}
        assert all(torch.equal(tensors[n], saved[n][rows[n].slices()]) for n in saved)
        # the bytes the core's data plane delivered to this worker: its rows of every tensor, once
        want = sum(rows[n].numel * t.element_size() for n, t in saved.items())
        assert out[0]["received"][w] == [want] and stats[0].bytes_received_per_worker[w] == want
        assert want < sum(t.numel() * t.element_size() for t in saved.values())  # not the whole adapter
    assert out[0]["shard_bytes"] == list(stats[0].bytes_received_per_worker.values())


def test_a_worker_whose_blocks_changed_since_init_fails_the_sync_at_the_digest_agreement():
    """The plan digest all parties agree on covers the adapter's destinations: a worker re-planned after
    the trainer planned makes every rank raise the same error before any byte moves; nothing commits."""
    out = _run(None, False, replanned=True)
    raised = [o.get("raised") for o in out]
    assert all(raised) and raised[0] == raised[1], raised
    assert "version 0 still serving" in raised[0] and "plan digest differs" in raised[0], raised[0]
    assert out[0]["served"] == [{}, {}] and out[0]["received"] == [[], []]


def test_an_engine_serving_another_base_is_refused_at_init_on_every_rank_naming_the_parameter():
    out = _run(None, False, other_base=True)
    raised = [o.get("raised") for o in out]
    assert all(raised), f"a rank returned instead of raising: {[o.get('returned') for o in out]}"
    assert raised[0] == raised[1], raised
    assert raised[0].startswith("Refused: parameter 'model.norm.weight': worker 1 serves other base weights than "
                                "the trainer's (its float32 values' fingerprint "), raised[0]
    assert raised[0].endswith("start it from the trainer's base checkpoint (not load_format='dummy', not another "
                              "model or revision)"), raised[0]
    assert out[0]["served"] == [{}, {}]  # nothing synced
