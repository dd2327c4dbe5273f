"""Speculative decoding: the drafter's weights synced with the target's (docs/drafter.md).

A tiny Llama target with an EAGLE head (vLLM 0.33's ``EagleLlamaForCausalLM``, built as vLLM's worker
builds it, the target's embedding and lm_head shared into it as vLLM's proposer shares them), FSDP 2 ->
TP 2, over M2N, NIXL and the broadcast (dense then delta) and IPC (dense): every parameter of the target
and of the drafter equals vLLM's own loading of the same checkpoint (the target's into the target, the
EAGLE checkpoint's into the drafter); on M2N and NIXL each worker receives exactly its shard bytes;
``SyncStats`` counts the drafter's bytes apart. The same for a tiny DeepSeek-V3-style target (MLA with
``q_lora_rank``) with one MTP layer (vLLM's ``DeepSeekMTP``), its tensors sent as ``model.layers.1.*``,
over M2N and the broadcast. A trainer that sends none of the drafter's tensors is refused at init on
every rank, naming the drafter and its parameters; one that declares ``drafter="frozen"`` syncs the
target and leaves the drafter as it is."""

from __future__ import annotations

import pytest
import torch

from helpers import init_info
from weightsync.registry import transport
from weightsync.testing.actors import RemoteError, free_port, gather
from weightsync.testing.cluster import Layout, model_config_dir

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

_D = "weightsync.testing.drafter:"
_T = "weightsync.testing.trainer:"
EAGLE = ("tiny_llama", "tiny_llama_eagle", "eagle")
LAYOUTS = {"m2n": Layout(trainers=2, tp=2, model="tiny_llama", backend="weightsync_m2n"),
           "broadcast": Layout(trainers=2, tp=2, model="tiny_llama", backend="weightsync_nccl"),
           "ipc": Layout(trainers=2, tp=2, model="tiny_llama", backend="weightsync_ipc"),
           "nixl": Layout(trainers=2, tp=2, model="tiny_llama", backend="weightsync_nixl")}
MTP = ("tiny_deepseek_mtp", "tiny_deepseek_mtp", "mtp")
MTP_LAYOUTS = {"m2n": Layout(trainers=2, tp=2, model="tiny_deepseek_mtp", backend="weightsync_m2n"),
               "broadcast": Layout(trainers=2, tp=2, model="tiny_deepseek_mtp", backend="weightsync_nccl")}
SOURCE = {"weightsync_m2n": "local", "weightsync_nccl": "full", "weightsync_ipc": "full", "weightsync_nixl": "local"}


def setup_pair(cluster, layout: Layout, spec: tuple[str, str, str]) -> list[str]:
    """The trainers (model + drafter) and receivers (target + drafter) of ``layout``; returns the
    drafter's own vLLM parameters."""
    target, draft, method = spec
    cluster.setup(layout, fresh=True)
    cluster._keys = None  # the receivers are rebuilt below: a later setup must rebuild them too
    port = free_port()
    own = gather([a.submit(_D + "setup_receiver", model_config_dir(target), model_config_dir(draft), method=method,
                           tp=layout.tp, rank=r, port=port, dtype=layout.dtype, backend=layout.backend,
                           timeout_s=1200)
                  for r, a in enumerate(cluster.active_receivers)])
    cluster.on_trainers(_D + "setup_trainer_drafter", model_config_dir(draft), method=method)
    return own[0]


def make_engines(cluster, layout: Layout, *, send_drafter: bool = True, **fields) -> None:
    info = init_info(layout.backend, layout, **fields)
    cluster.on_trainers("make_engine", info, cluster.client(), source=SOURCE[layout.backend], drafter=send_drafter)


def check_exact(cluster) -> None:
    target_sd = cluster.on_trainers("full_state_dict")[0]
    drafter_sd = cluster.on_trainers(_D + "drafter_state_dict")[0]
    assert cluster.on_receivers(_D + "compare_with_oracle", target_sd, drafter_sd) == [[], []]


def sync_dense_then_delta(cluster, layout: Layout, own: list[str]) -> None:
    """Dense, then two train steps (target and drafter) as deltas where the transport has them: after
    each, every parameter of both equals vLLM's own loading; on M2N each worker receives its shards."""
    written = [n for n in own if "norm" not in n]  # (norms start at ones on both sides)
    cluster.on_receivers(_D + "fill_drafter", written, 7.0)  # a value the sync must replace
    before = cluster.on_receivers(_D + "drafter_params")
    delta = transport(layout.backend).capabilities.delta
    make_engines(cluster, layout, delta=delta)
    stats = cluster.sync("v0")
    check_exact(cluster)
    after = cluster.on_receivers(_D + "drafter_params")
    assert written and all(not torch.equal(before[0][n], after[0][n]) for n in written), "the drafter was written"
    drafter = stats["drafter_bytes_per_worker"]
    assert sorted(drafter) == [0, 1] and all(0 < b < stats["bytes_received_per_worker"][w] for w, b in drafter.items())
    if SOURCE[layout.backend] == "local":  # M2N, NIXL: exactly the shards, the drafter's included
        assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]
    for step in (1, 2):
        cluster.train_step(step, lr=1e-4)
        cluster.on_trainers(_D + "perturb_drafter", step)
        stats = cluster.sync(f"v{step}")
        check_exact(cluster)
        assert not delta or stats["delta"]["base"] == step, stats["delta"]
        assert stats["drafter_bytes_per_worker"] == drafter
    cluster.on_trainers("shutdown_engine")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eagle_head_synced_with_the_target_dense_then_delta(cluster, name):
    layout = LAYOUTS[name]
    own = setup_pair(cluster, layout, EAGLE)
    assert own and all(n.startswith("drafter.model.") for n in own)
    assert "drafter.model.fc.weight" in own and not any("embed_tokens" in n for n in own)  # shared: the target's
    sync_dense_then_delta(cluster, layout, own)


@pytest.mark.parametrize("name", list(MTP_LAYOUTS))
def test_deepseek_mtp_layer_synced_with_the_target_dense_then_delta(cluster, name):
    """DeepSeek-V3-style target (MLA with ``q_lora_rank``, dense MLP) with one MTP layer (vLLM's
    ``DeepSeekMTP``), TP 2: the trainer sends the layer as its checkpoint names it, ``model.layers.1.*``
    (the target has one layer)."""
    layout = MTP_LAYOUTS[name]
    own = setup_pair(cluster, layout, MTP)
    layer = "drafter.model.layers.1."
    assert {layer + "eh_proj.weight", layer + "mtp_block.mlp.gate_up_proj.weight",
            layer + "mtp_block.self_attn.fused_qkv_a_proj.weight"} <= set(own)  # q_lora_rank set: q_a + kv_a fused
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in own)  # shared: the target's
    sync_dense_then_delta(cluster, layout, own)


def test_a_trainer_that_sends_no_drafter_tensors_is_refused_on_every_rank(cluster):
    layout = LAYOUTS["m2n"]
    own = setup_pair(cluster, layout, EAGLE)
    info = init_info(layout.backend, layout)
    futs = [a.submit(_T + "make_engine", info, cluster.client(), source="local")
            for a in cluster.active_trainers]
    errors = []
    for f in futs:
        with pytest.raises(RemoteError) as e:
            f.result(timeout=600)
        errors.append(str(e.value).split("\nTraceback")[0])
    for text in errors:
        assert "Refused" in text and "EagleLlamaForCausalLM" in text and "drafter='frozen'" in text, text
        assert repr(own[0]) in text, text


def test_a_frozen_drafter_is_kept_as_it_is(cluster):
    layout = LAYOUTS["broadcast"]
    setup_pair(cluster, layout, EAGLE)
    before = cluster.on_receivers(_D + "drafter_params")
    make_engines(cluster, layout, send_drafter=False, drafter="frozen")
    stats = cluster.sync("v0")
    assert stats["drafter_bytes_per_worker"] == {}
    after = cluster.on_receivers(_D + "drafter_params")
    raw = lambda t: t.contiguous().view(-1).view(torch.uint8)  # noqa: E731 - bytes: unwritten values may be NaN
    assert all(torch.equal(raw(before[w][n]), raw(after[w][n])) for w in range(2) for n in before[w])
    target_sd = cluster.on_trainers("full_state_dict")[0]
    assert cluster.on_receivers(_D + "compare_with_oracle", target_sd, None) == [[], []]
    cluster.on_trainers("shutdown_engine")


# --- no processes: the trainer side and the init info ------------------------------------------------

def test_the_sources_send_the_drafter_after_the_model_under_its_own_names():
    from weightsync import DTensorModuleSource, FullTensorSource

    model, head = torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.Module()
    head.fc = torch.nn.Linear(8, 4, bias=False)
    full = FullTensorSource(model, drafter=head)
    assert [m.name for m in full.metadata] == ["0.weight", "0.bias", "fc.weight"]
    assert [n for n, _ in full.iter_full()] == ["0.weight", "0.bias", "fc.weight"]
    local = DTensorModuleSource(model, 1, drafter=head)
    assert [n for n, _ in local.iter_local()] == ["0.weight", "0.bias", "fc.weight"]


def test_a_drafter_name_that_is_also_the_models_is_refused_naming_it():
    from weightsync import FullTensorSource

    model, head = torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"the drafter's parameter name\(s\) \['0.bias', '0.weight'\] are also "
                                         r"the model's: send the drafter's under 'drafter.<name>'"):
        _ = FullTensorSource(model, drafter=head).metadata


def test_the_drafter_field_takes_synced_or_frozen():
    from weightsync.transports.m2n import M2NTrainerInitInfo

    with pytest.raises(ValueError, match=r"M2NTrainerInitInfo.drafter must be 'synced' or 'frozen', got 'stale'"):
        M2NTrainerInitInfo.for_deployment(num_trainer_ranks=1, replicas=1, tp=2, drafter="stale")
    info = M2NTrainerInitInfo.for_deployment(num_trainer_ranks=1, replicas=1, tp=2, drafter="frozen")
    assert info.drafter == "frozen"
