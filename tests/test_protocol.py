import subprocess
import sys

import pytest
import torch

from weightsync import (
    FullTensorSource,
    ParamMeta,
    WeightSource,
    WeightTransferTrainerFactory,
    WorkerEngineFactory,
    transport_names,
)
from weightsync.infos import parse_info
from weightsync.protocol import dtype_from_name, dtype_name
from weightsync.transports.nccl import NCCLTrainerInitInfo, NCCLUpdateInfo, NCCLWorkerInitInfo


def test_import_pulls_in_no_vllm_ray_nccl_or_nixl():
    code = ("import weightsync, weightsync.transports.nccl, weightsync.transports.nixl, sys; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'ray', 'nccl', 'nixl', 'nixl_cu12', "
            "'nixl_cu13'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_parse_info_turns_bad_fields_into_value_errors():
    ok = parse_info(NCCLWorkerInitInfo, {"master_address": "h", "master_port": 1, "world_size": 3})
    assert ok.engine_index == 0 and ok.bucket_bytes == 256 << 20
    with pytest.raises(ValueError, match=r"field 'world_size' must be an int, got '3'"):
        parse_info(NCCLWorkerInitInfo, {"master_address": "h", "master_port": 1, "world_size": "3"})
    with pytest.raises(ValueError, match=r"field 'shapes' element 0 element 1 must be an int, got \[\[1, 'x'\]\]"):
        parse_info(NCCLUpdateInfo, {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1, "x"]]})
    with pytest.raises(ValueError, match=r"field 'verify' must be a bool, got 1"):
        parse_info(NCCLUpdateInfo, {"verify": 1})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['worldsize'\]"):
        parse_info(NCCLWorkerInitInfo, {"master_address": "h", "master_port": 1, "worldsize": 3})
    with pytest.raises(ValueError, match="missing 1 required keyword-only argument: 'world_size'"):
        parse_info(NCCLWorkerInitInfo, {"master_address": "h", "master_port": 1})
    with pytest.raises(ValueError, match="must be a dict, got list"):
        parse_info(NCCLWorkerInitInfo, [1])
    with pytest.raises(ValueError, match="names, dtype_names and shapes must have equal lengths, got 1, 0, 0"):
        parse_info(NCCLUpdateInfo, {"sync_id": 1, "digest": "x", "names": ["a"]})


def test_trainer_init_info_validation_names_the_field():
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        NCCLTrainerInitInfo(master_address="h", master_port=1, world_size=1, rank=0)
    with pytest.raises(ValueError, match="rank must be an int >= 0, got -1"):
        NCCLTrainerInitInfo(master_address="h", master_port=1, world_size=2, rank=-1)
    with pytest.raises(ValueError, match="bucket_bytes must be a positive multiple of 256, got 1000"):
        NCCLTrainerInitInfo(master_address="h", master_port=1, world_size=2, rank=0, bucket_bytes=1000)
    with pytest.raises(TypeError):
        NCCLTrainerInitInfo("h", 1, 2, 0)  # rank is keyword-only; everything else too


def test_dtype_names_roundtrip_and_reject_unknown():
    for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64):
        assert dtype_from_name(dtype_name(dt)) is dt
    with pytest.raises(ValueError, match="unknown dtype name 'float128'"):
        dtype_from_name("float128")
    with pytest.raises(ValueError, match="parameter 'x': dtype torch.complex64 is not supported"):
        ParamMeta("x", torch.complex64, (1,))


def test_registries_are_lazy_and_list_names():
    assert transport_names() == ["weightsync_ipc", "weightsync_m2n", "weightsync_nccl", "weightsync_nixl"]
    assert WorkerEngineFactory.engine_class("weightsync_nccl").__name__ == "NCCLWorkerEngine"
    with pytest.raises(ValueError, match="unknown weight-transfer backend 'nccl'"):
        WorkerEngineFactory.engine_class("nccl")  # one name per transport
    with pytest.raises(ValueError, match=r"unknown weight-transfer backend 'gloo'; available: "
                                         r"\['weightsync_ipc', 'weightsync_m2n', 'weightsync_nccl', "
                                         r"'weightsync_nixl'\]"):
        WeightTransferTrainerFactory.engine_class("gloo")
    with pytest.raises(TypeError, match="init_info must be a TrainerInitInfo, got dict"):
        WeightTransferTrainerFactory.trainer_init({}, client=None)


def test_metadata_must_be_cached_property():
    with pytest.raises(TypeError, match="Bad.metadata must be a functools.cached_property"):
        class Bad(WeightSource):  # noqa: F841
            @property
            def metadata(self):
                return []


def test_full_tensor_source_on_plain_module_in_parameter_order_with_buckets():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2, bias=False))
    src = FullTensorSource(m, bucket_bytes=100, dtype=torch.bfloat16)
    assert [(p.name, p.dtype, p.shape) for p in src.metadata] == [
        ("0.weight", torch.bfloat16, (8, 4)), ("0.bias", torch.bfloat16, (8,)), ("1.weight", torch.bfloat16, (2, 8))]
    got = dict(src.iter_full())
    assert list(got) == ["0.weight", "0.bias", "1.weight"]
    assert all(torch.equal(got[n], p.detach().to(torch.bfloat16)) for n, p in m.named_parameters())


def test_full_tensor_source_name_map_skips_and_rejects_collisions():
    m = torch.nn.Linear(2, 2)
    src = FullTensorSource(m, name_map=lambda n: None if n == "bias" else f"model.{n}")
    assert [p.name for p in src.metadata] == ["model.weight"]
    with pytest.raises(ValueError, match=r"name_map maps several parameters to the same name\(s\): \['x'\]"):
        _ = FullTensorSource(m, name_map=lambda n: "x").metadata


def test_paused_keeps_generation_paused_only_after_a_sync_that_may_have_torn_the_weights():
    from weightsync.clients import paused
    from weightsync.errors import SyncFailed

    class Recorder:
        def __init__(self):
            self.calls = []

        def pause_generation(self, mode, clear_cache):
            self.calls.append(("pause", mode, clear_cache))

        def resume_generation(self):
            self.calls.append(("resume",))

    for error, resumed in [(None, True), (SyncFailed("x", restored=True), True), (ValueError("bad input"), True),
                           (SyncFailed("y", restored=False), False)]:
        client = Recorder()
        try:
            with paused(client, mode="wait", clear_cache=False):
                if error is not None:
                    raise error
        except Exception as e:  # noqa: BLE001 - re-raised unchanged
            assert e is error
        assert client.calls == [("pause", "wait", False)] + ([("resume",)] if resumed else []), error


def _wrapped_model() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A model with per-expert MoE weights, its layers checkpoint-wrapped and the whole compiled: the
    wrapped module and the model itself."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Module()
            self.mlp.experts = torch.nn.ModuleList()
            for _ in range(2):
                expert = torch.nn.Module()
                expert.gate_proj = torch.nn.Linear(4, 3, bias=False)
                self.mlp.experts.append(expert)

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([Layer(), Layer()])
    model.lm_head = torch.nn.Linear(4, 5, bias=False)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Layer))
    return torch.compile(model), model


def test_sources_send_a_compiled_checkpoint_wrapped_model_under_its_unwrapped_names():
    from weightsync.trainer.sources import DTensorModuleSource

    wrapped, model = _wrapped_model()
    raw = [n for n, _ in wrapped.named_parameters()]
    assert raw[0] == "_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.experts.0.gate_proj.weight"
    want = ([f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight" for i in range(2) for e in range(2)]
            + ["lm_head.weight"])
    assert [m.name for m in FullTensorSource(wrapped).metadata] == want
    local = DTensorModuleSource(wrapped, 1)
    assert [m.name for m in local.metadata] == want
    assert all(torch.equal(t, model.get_parameter(n)) for n, t in local.iter_local())
    seen: list[str] = []
    mapped = FullTensorSource(wrapped, name_map=lambda n: seen.append(n) or (None if n.startswith("lm_head") else n))
    assert [m.name for m in mapped.metadata] == want[:-1] and seen == want  # name_map sees unwrapped names
    fused = DTensorModuleSource(wrapped, 1, fuse_experts=True)
    assert [m.name for m in fused.metadata] == \
        [f"model.layers.{i}.mlp.experts.gate_proj" for i in range(2)] + ["lm_head.weight"]
    stacked = dict(fused.iter_local())["model.layers.1.mlp.experts.gate_proj"]
    assert torch.equal(stacked, torch.stack([model.model.layers[1].mlp.experts[e].gate_proj.weight for e in range(2)]))


def test_a_refusal_reads_the_same_whichever_party_reported_it_first():
    """A worker's refusal reaches every trainer rank as ``Refused``, also when another trainer rank read it
    first and reported its own ``Refused`` on the store (the failed CI run's race: rank 0 raised
    ``DataPlaneError: a party failed: trainer rank 1: Refused: ...``)."""
    from weightsync.errors import Refused, refusal

    worker = "worker 0: ValueError: parameter 'w': the trainer's shape (160, 64) does not match"
    for reported in (worker, f"trainer rank 1: Refused: {worker}"):
        err = refusal(reported)
        assert isinstance(err, Refused) and str(err) == worker, reported
    for other in ("worker 0: RuntimeError: boom", "trainer rank 1: DataPlaneError: timed out", "workers: x", None):
        assert refusal(other) is None, other
