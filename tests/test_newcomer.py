"""What a newcomer meets first (issue 41): the shipped configs located by API, a refusal at init raised as
a ``ValueError`` carrying the worker's message on every trainer rank, Ray's errors trimmed to their
cause (a dead engine core said to be one), ``SyncStats``'s repr and docs, no vLLM reload warnings
for layers that take no weights, and a pipeline stage's worker taking only its own layers."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading

import pytest
import torch

import weightsync
from weightsync import EngineDead, FullTensorSource, Refused, RemoteCallError, SyncStats, WeightTransferTrainerFactory
from weightsync.comm import Communicator
from weightsync.stats import DeltaStats
from weightsync.testing.actors import free_port
from weightsync.transports.nccl import NCCLTrainerInitInfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 30.0


# --- weightsync.configs ----------------------------------------------------------------------------
def test_every_shipped_config_is_located_by_name():
    names = weightsync.configs.names()
    assert {"tiny_qwen3", "small_qwen3", "tiny_llama"} <= set(names)
    for name in names:
        with open(os.path.join(weightsync.configs.path(name), "config.json")) as f:
            assert json.load(f)["architectures"], name


def test_an_unknown_config_name_is_refused_listing_the_shipped_ones():
    with pytest.raises(ValueError, match=r"^name must be one of the shipped configs \['small_qwen3', .*'tiny_qwen3', "
                                         r".*\], got 'tiny_qwen4'$"):
        weightsync.configs.path("tiny_qwen4")


# --- a refusal at init ------------------------------------------------------------------------------
class RefusingClient:
    """Answers init as a vLLM worker that refused the trainer's model does: it reports its
    ``ValueError`` on the trainer's store (``WorkerEngine`` does exactly this) and returns."""

    def __init__(self, report: str) -> None:
        self.report = report

    def init_weight_transfer_engine(self, init_info):
        Communicator.report(init_info["master_address"], init_info["master_port"], self.report)


def init_on_ranks(ranks: int, report: str) -> list[BaseException]:
    """``trainer_init`` of the broadcast transport on ``ranks`` trainer ranks (threads), the engine's
    single worker refusing; what each rank raised."""
    port, errors = free_port(), [None] * ranks

    def rank(r: int) -> None:
        info = NCCLTrainerInitInfo.for_deployment(num_trainer_ranks=ranks, replicas=1, tp=1, rank=r, device="cpu",
                                                  master_address="127.0.0.1", master_port=port, timeout_s=TIMEOUT_S)
        try:
            WeightTransferTrainerFactory.trainer_init(info, client=RefusingClient(report) if r == 0 else None,
                                                      source=FullTensorSource(torch.nn.Linear(4, 4)))
        except BaseException as e:  # noqa: BLE001 - the outcome under test
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3 * TIMEOUT_S)
    assert all(e is not None for e in errors), errors
    return errors


REFUSAL = ("worker 0: ValueError: parameter 'weight': the trainer's shape (4, 4) does not match vLLM's weight "
           "(8, 4) (dim 0: 8, the trainer's 4)")


@pytest.mark.parametrize("ranks", [1, 2], ids=["one trainer rank", "two trainer ranks"])
def test_a_model_refused_at_init_is_a_value_error_with_the_workers_message_on_every_rank(ranks):
    for e in init_on_ranks(ranks, REFUSAL):
        assert type(e) is Refused and isinstance(e, ValueError), repr(e)
        assert str(e) == REFUSAL


def test_a_worker_failing_init_for_another_reason_is_not_a_refusal():
    failure = "worker 0: RuntimeError: gloo connect timed out"
    (e,) = init_on_ranks(1, failure)
    assert not isinstance(e, ValueError) and isinstance(e, RuntimeError) and failure in str(e), repr(e)


def test_refused_and_engine_dead_are_exported():
    assert {"Refused", "EngineDead", "SyncFailed", "PoisonedError", "configs"} <= set(weightsync.__all__)
    assert issubclass(Refused, ValueError) and issubclass(EngineDead, RemoteCallError)


# --- Ray's errors, trimmed -------------------------------------------------------------------------------
MODEL_REPR = "Qwen3ForCausalLM(\n" + "".join(f"  (layer{i}): Linear(in_features=64)\n" for i in range(30)) + ")"


class FakeRayTaskError(Exception):
    """What ``ray.get`` raises for an actor method that raised: the remote exception as ``cause``, the
    remote traceback as ``traceback_str``, and the actor's repr in its text."""

    def __init__(self, cause: BaseException, traceback_str: str) -> None:
        super().__init__(f"ray::LLM.start_weight_update() (pid=7, repr={MODEL_REPR})\n{traceback_str}")
        self.cause, self.traceback_str = cause, traceback_str


TRACEBACK = ('Traceback (most recent call last):\n  File "llm.py", line 10, in start_weight_update\n    f()\n'
             '  File "core_client.py", line 42, in call_utility\n    raise E()\n')


def test_a_remote_error_is_trimmed_to_its_cause_and_where_it_was_raised():
    from weightsync.clients import remote_call_error

    e = remote_call_error("start_weight_update", FakeRayTaskError(RuntimeError("disk on fire"), TRACEBACK))
    assert type(e) is RemoteCallError
    assert str(e) == ('start_weight_update failed on an inference actor: RuntimeError: disk on fire '
                      '(at File "core_client.py", line 42, in call_utility)')


class _Resources:
    engine_dead = False


class FakeLLM:
    """What ``llm_calls.watched`` reads of vLLM's ``LLM``: ``llm_engine.engine_core.resources.engine_dead``."""

    def __init__(self) -> None:
        self.llm_engine = type("Engine", (), {"engine_core": type("Core", (), {"resources": _Resources()})()})()


@pytest.mark.vllm
def test_a_call_in_flight_when_the_engine_core_dies_fails_at_once():
    """vLLM's client waits forever on a call sent before its monitor marked the core dead; ``watched``
    raises vLLM's ``EngineDeadError`` once it is marked, and passes results and errors through."""
    pytest.importorskip("vllm")
    from weightsync.llm_calls import is_llm, watched

    llm, sent, never = FakeLLM(), threading.Event(), threading.Event()

    def hangs(actor):
        sent.set()
        never.wait()

    def mark_dead():
        sent.wait()
        llm.llm_engine.engine_core.resources.engine_dead = True

    threading.Thread(target=mark_dead, daemon=True).start()
    with pytest.raises(Exception) as dead:
        watched(llm, hangs)
    assert type(dead.value).__name__ == "EngineDeadError"
    assert is_llm(llm) and not is_llm(object())
    assert watched(FakeLLM(), lambda actor, x: x + 1, 41) == 42
    with pytest.raises(KeyError, match="nope"):
        watched(FakeLLM(), lambda actor: {}["nope"])
    assert watched(object(), lambda actor: "not an LLM: called as it is") == "not an LLM: called as it is"
    never.set()


@pytest.mark.vllm
def test_a_dead_engine_core_is_said_to_need_a_restart():
    pytest.importorskip("vllm")
    from vllm.v1.engine.exceptions import EngineDeadError

    from weightsync.clients import remote_call_error

    e = remote_call_error("start_weight_update", FakeRayTaskError(EngineDeadError(), TRACEBACK))
    assert type(e) is EngineDead
    assert str(e) == ("start_weight_update failed on an inference actor: vLLM's engine core is dead (EngineDeadError: "
                      "EngineCore encountered an issue. See stack trace (above) for the root cause.); the actor is "
                      "alive, but every call fails until the engine restarts: restart the engine, then trainer_init")


# --- SyncStats -------------------------------------------------------------------------------------------
def test_sync_stats_repr_shows_seconds_and_what_users_read():
    stats = SyncStats("weightsync_nccl", 0, bytes_sent=2_000_000, bytes_received_per_worker={0: 2_000_000},
                      phases={"preflight": 0.00012, "transfer": 0.4, "finish": 0.1}, weight_version="step1",
                      verified=True)
    assert repr(stats).startswith("SyncStats(backend='weightsync_nccl', rank=0, weight_version='step1', "
                                  "seconds=0.5001, gbps=0.004, verified=True, bytes_sent=2000000, ")
    assert "phases={'preflight': 0.0001, 'transfer': 0.4, 'finish': 0.1}" in repr(stats)
    stats.delta = DeltaStats(base=3, workers=[0])
    assert repr(stats).endswith(", delta=DeltaStats(base=3, workers=[0], changed=0, compared=0, dense_bytes=0, "
                                "diff_seconds=0.0, baseline_bytes=0))")


def test_every_sync_stats_field_is_documented():
    with open(os.path.join(ROOT, "docs", "first_script.md")) as f:
        page = f.read()
    rows = set(re.findall(r"^\| `(\w+)` \|", page, flags=re.M))
    assert rows == {f.name for f in dataclasses.fields(SyncStats)} | {"seconds", "gbps"}
    for name in [f.name for f in dataclasses.fields(DeltaStats)] + ["changed_fraction"]:
        assert f"`{name}`" in page, name


# --- vLLM's layerwise-reload warnings ---------------------------------------------------------------
class Rotary(torch.nn.Module):  # like vLLM's RotaryEmbedding: a cache buffer, no weights
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.arange(8.0), persistent=False)


class Embedding(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None else torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)


class TiedHead(Embedding):  # like a tied lm_head: its weight is the embedding's
    pass


class Dense(Embedding):
    pass


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rotary, self.dense = Embedding(), Rotary(), Dense()
        self.head = TiedHead(self.embed.weight)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:  # vLLM's layerwise reload wraps the parameter's loader, or this default
            getattr(params[name], "weight_loader", lambda param, x: param.data.copy_(x))(params[name], t)
        return {name for name, _ in weights}


@pytest.mark.vllm
def test_reload_warns_only_for_a_layer_with_weights_that_got_none():
    """Through vLLM's own layerwise reload: the embedding loads; the rotary cache and the tied head
    take no weights (no warning); the dense layer should have loaded and did not (vLLM's warning)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    from weightsync.worker.applier import LayerwiseApplier

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("vllm").addHandler(handler)
    try:
        model = Model()
        record_metadata_for_reloading(model)
        applier = LayerwiseApplier(model, None, rollback=False)
        applier.start()
        applier.load([("embed.weight", torch.ones(4, 4))])
        applier.finish()
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    assert [m for m in messages if "Failed to load weights" in m] == ["Dense: Failed to load weights"]
    assert torch.equal(model.embed.weight, torch.ones(4, 4)) and model.head.weight is model.embed.weight
    assert torch.equal(model.rotary.cos_sin_cache, torch.arange(8.0)) and torch.equal(model.dense.weight,
                                                                                       torch.zeros(4, 4))


def test_a_pipeline_stage_leaves_other_stages_layers_unplaced_and_still_refuses_unknown_names():
    """The worker side of ``tests/engine/test_engine_pp.py``, on a model with vLLM's own placeholder."""
    utils = pytest.importorskip("vllm.model_executor.models.utils")
    from weightsync.worker.agreement import check_model

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module(), utils.PPMissingLayer()])  # this worker: stage 0
    model.model.layers[0].norm = torch.nn.Module()
    model.model.layers[0].norm.weight = torch.nn.Parameter(torch.ones(4))
    metas = [(f"model.layers.{i}.norm.weight", "float32", (4,)) for i in range(2)]
    assert [p.name for p in check_model(model, metas).pieces] == ["model.layers.0.norm.weight"]
    for bad in ("model.layers.0.nrm.weight", "model.layers.2.norm.weight"):
        with pytest.raises(ValueError, match=rf"parameter '{re.escape(bad)}': the trainer sends it, but vLLM's "
                                             r"Module has no parameter or fused layer for it"):
            check_model(model, [*metas, (bad, "float32", (4,))])
