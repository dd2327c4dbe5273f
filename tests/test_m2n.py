"""M2N end to end on CPU: FSDP2 shards straight into live vLLM parameters (TP over gloo), checked
against vLLM's own ``load_weights`` of the trainer's full state dict, with no gather on the trainer.
Bad inputs and faulty sources: ``test_failures.py``.

First the plan alone: destinations read from vLLM's real model classes + the transfer plan, executed by
the reference executor from the trainers' FSDP2 local shards, give every vLLM parameter exactly what
vLLM's own ``load_weights`` of the full state dict gives; no byte falls back."""

from __future__ import annotations

import pytest
import torch

from helpers import TRANSPORTS, execute_reference, init_info, mismatches
from weightsync.plan import build_plan
from weightsync.registry import transport
from weightsync.testing.actors import RemoteError
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODELS = ["tiny_qwen3", "tiny_qwen3_kv1", "tiny_llama", "tiny_qwen2"]


def plan_and_check(cluster, layout: Layout) -> dict:
    cluster.setup(layout)
    per_rank = cluster.on_trainers("local_shards")
    sources = per_rank[0][0]
    assert all(r[0] == sources for r in per_rank), "every trainer rank derives the same sources"
    shards = {rank: r[1] for rank, r in enumerate(per_rank)}
    wire = [(s.name, s.dtype, list(s.shape)) for s in sources]
    dests = cluster.on_receivers("destinations", wire)
    assert [d.fallbacks for d in dests] == [()] * layout.num_workers
    plan = build_plan(sources, [d.pieces for d in dests])
    assert plan.coverage().ratio == 1.0
    params = {w: {n: torch.zeros(shape, dtype=getattr(torch, d.param_dtypes[n])) for n, shape in d.param_shapes.items()}
              for w, d in enumerate(dests)}
    execute_reference(plan, shards, params)
    full = cluster.on_trainers("full_state_dict")[0]
    bad = [a.call("weightsync.testing.receiver:compare_tensors_with_oracle", params[w], full)
           for w, a in enumerate(cluster.active_receivers)]
    assert bad == [[]] * layout.num_workers
    return {"dests": dests, "plan": plan, "full": full}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_plan_matches_vllm_load_weights(cluster, model, tp):
    for trainers in (1, 2, 3):
        out = plan_and_check(cluster, Layout(trainers=trainers, tp=tp, model=model))
    dests, full = out["dests"], out["full"]
    # Tied embeddings (Qwen3): no lm_head in the source, so nothing is sent twice.
    assert ("lm_head.weight" in full) == (model in ("tiny_llama", "tiny_qwen2"))
    # Every byte of every destination piece is shard-sized, never the full tensor, when TP > 1:
    if tp > 1:
        q = [p for p in dests[0].pieces if p.name.endswith("self_attn.q_proj.weight")][0]
        assert q.region.sizes[0] * tp == full[q.name].shape[0]


def test_kv_head_replication_and_vocab_padding_at_tp4(cluster):
    out = plan_and_check(cluster, Layout(trainers=2, tp=4, model="tiny_qwen3"))
    dests = out["dests"]
    k = "model.layers.0.self_attn.k_proj.weight"  # 2 KV heads of 32 over TP 4: ranks 0,1 head 0; 2,3 head 1
    rows = [[p.region.offsets[0] for p in d.pieces if p.name == k] for d in dests]
    assert rows == [[0], [0], [32], [32]]
    emb = "model.embed_tokens.weight"  # vocab 151 padded to 192: 48 rows per rank, the last gets 7 real rows
    spans = [[(p.region.offsets[0], p.region.sizes[0]) for p in d.pieces if p.name == emb] for d in dests]
    assert spans == [[(0, 48)], [(48, 48)], [(96, 48)], [(144, 7)]]


# --- end to end ---------------------------------------------------------------------------------------


def sync_without_gathers(cluster, version: str) -> list[dict]:
    return cluster.on_trainers("weightsync.testing.probes:send_weights_without_gathers", version)


def check_two_syncs(cluster, layout: Layout, seed: int) -> None:
    cluster.setup(layout)
    cluster.make_engines(init_info("weightsync_m2n", layout), source="local")
    for step in range(2):
        cluster.train_step(seed + step)
        assert mismatches(cluster), "the optimizer step changed the trainer's weights"
        stats = sync_without_gathers(cluster, f"v{step}")[0]
        assert mismatches(cluster) == {}, layout
        # each worker received exactly its shard bytes: ratio to the lower bound 1.00
        assert stats["received"] == stats["lower_bound"] and len(stats["received"]) == layout.num_workers
    assert cluster.client().weight_versions() == ["v1"] * layout.num_workers


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_m2n_fsdp_1_2_3_to_tp(cluster, tp):
    for trainers in (1, 2, 3):
        check_two_syncs(cluster, Layout(trainers=trainers, tp=tp, backend="weightsync_m2n"), seed=10 * trainers)


@pytest.mark.parametrize("layout", [
    Layout(trainers=2, tp=2, replicas=2, backend="weightsync_m2n"),
    Layout(trainers=2, tp=2, model="tiny_llama", backend="weightsync_m2n"),
    Layout(trainers=2, tp=2, dtype="bfloat16", backend="weightsync_m2n"),
    Layout(trainers=3, tp=2, dtype="bfloat16", model="tiny_llama", backend="weightsync_m2n"),
], ids=["qwen3-2x2", "llama", "qwen3-bf16", "llama-bf16-3to2"])
def test_m2n_replicas_llama_bf16(cluster, layout):
    check_two_syncs(cluster, layout, seed=7)


def test_tp_aligned_shards(cluster):
    """FSDP2 shards the row-parallel weights on dim 1 (``ModelConfig.tp_aligned_shards``): bit-exact,
    and with as many trainer ranks as TP only the small messages that pack several items go through
    staging, against over a tenth of the bytes with dim-0 shards."""
    layout = Layout(trainers=2, tp=2, tp_aligned=True, model="small_qwen3", backend="weightsync_m2n")
    check_two_syncs(cluster, layout, seed=3)  # (small: pieces big enough to go alone)
    aligned = cluster.on_trainers("weightsync.testing.probes:m2n_staged_bytes")
    default = Layout(trainers=2, tp=2, model="small_qwen3", backend="weightsync_m2n")
    cluster.setup(default)
    cluster.make_engines(init_info("weightsync_m2n", default), source="local")
    rows = cluster.on_trainers("weightsync.testing.probes:m2n_staged_bytes")
    assert all(s["staged"] < s["total"] / 100 for s in aligned), aligned
    assert all(s["staged"] > s["total"] / 10 for s in rows), rows


def test_tp_aligned_shards_need_even_columns(cluster):
    with pytest.raises(RemoteError, match="ModelConfig.tp_aligned_shards: parameter 'model.layers.0.self_attn.o_proj"
                                          ".weight' has 128 columns, which do not divide by the 3 FSDP ranks"):
        cluster.setup(Layout(trainers=3, tp=2, tp_aligned=True, backend="weightsync_m2n"))


def test_gather_guard_catches_a_gathering_transport(cluster):
    """The guard used above is real: the broadcast path (full_tensor) trips it."""
    layout = Layout(trainers=2, tp=2)
    cluster.setup(layout)
    cluster.make_engines(init_info("weightsync_nccl", layout, timeout_s=30))
    futs = [a.submit("weightsync.testing.probes:send_weights_without_gathers", "x") for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match="full_tensor called during send_weights"):
            f.result()


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_workers_report_their_own_phases(cluster, backend):
    """``SyncStats.worker_phases``: every worker's own start / receive / finish seconds, from the
    engines (no instrumentation); receiving the weights is most of a worker's sync here. Rank 0's
    phases add up to no more than its sync. A shard-exact transport's workers receive their shard's bytes."""
    from helpers import SOURCES, init_info

    layout = Layout(trainers=2, tp=2, backend=backend)
    cluster.setup(layout)
    cluster.make_engines(init_info(backend, layout), source=SOURCES[backend])
    stats = cluster.sync("phases")
    if transport(backend).capabilities.shard_exact:
        assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]
    assert sorted(stats["worker_phases"]) == list(range(layout.num_workers))
    for w, phases in stats["worker_phases"].items():
        assert set(phases) == {"start", "receive", "finish"}, (w, phases)
        assert all(0 <= s < stats["seconds"] for s in phases.values()), (w, phases, stats["seconds"])
        assert phases["receive"] > 0
    # rank 0's own: the wait for the engines' start counts once, in "start" (a sender packs meanwhile)
    assert set(stats["phases"]) == {"preflight", "start", "transfer", "finish"}, stats["phases"]
    assert all(s >= 0 for s in stats["phases"].values()) and sum(stats["phases"].values()) <= stats["seconds"]


def test_successful_syncs_and_reinits_log_no_stack_trace_in_the_workers(cluster, tmp_path):
    """Issue 58: a worker's store client outlived its trainer's store, so the next init's look at the old
    session logged torch's C++ trace ("recvVector failed ... Connection was likely closed") into the
    engine's log although every sync succeeded. Now the trainer's shutdown has its workers leave first."""
    layout = Layout(trainers=2, tp=2, backend="weightsync_m2n")
    cluster.setup(layout)
    logs = {a.name: tmp_path / f"{a.name}.log" for a in cluster.active_receivers}
    cluster.on_receivers("helpers:stderr_to", None)  # (none left redirected by an earlier run)
    for a in cluster.active_receivers:
        a.call("helpers:stderr_to", str(logs[a.name]))
    try:
        for version in ("a", "b", "c"):
            cluster.make_engines(init_info("weightsync_m2n", layout), source="local")
            cluster.train_step(len(version) + ord(version))
            cluster.sync(version)
            cluster.on_trainers("shutdown_engine")
        cluster.make_engines(init_info("weightsync_m2n", layout), source="local")
        cluster.sync("d")
    finally:
        cluster.on_receivers("helpers:stderr_to", None)
    assert mismatches(cluster) == {}
    for name, log in logs.items():
        text = log.read_text()
        assert text.startswith("stderr of pid "), (name, text[:200])  # the capture itself works
        traces = ("recvVector", "Traceback", "Exception raised from")
        bad = [ln for ln in text.splitlines() if any(s in ln for s in traces)]
        assert bad == [], (name, text[-4000:])
