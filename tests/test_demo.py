"""The main job and the examples' CPU modes, run exactly as a user runs them."""

import os
import subprocess
import sys
import time

import pytest

from helpers import HAS_VLLM, TRANSPORTS

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed"),
              pytest.mark.timeout(900)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTSYNC = os.path.join(os.path.dirname(sys.executable), "weightsync")


def test_demo_rejects_a_name_the_registry_does_not_know():
    out = subprocess.run([WEIGHTSYNC, "demo", "--transport", "nccl_m2n"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 2 and "invalid choice: 'nccl_m2n'" in out.stderr, out.stderr


def run(*cmd: str) -> str:
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def verified_rows(stdout: str, transport: str) -> list[str]:
    return [line for line in stdout.splitlines()
            if line.startswith(f"| {transport} ") and line.rstrip().endswith("| verified |")]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_demo_transport_2_trainers_tp2_exits_0_and_prints_verified(transport):
    stdout = run(WEIGHTSYNC, "demo", "--transport", transport, "--trainers", "2", "--tp", "2")
    assert len(verified_rows(stdout, transport)) == 1, stdout


def test_demo_without_flags_runs_every_transport_verified_under_5_minutes():
    t0 = time.perf_counter()
    stdout = run(WEIGHTSYNC, "demo")
    assert time.perf_counter() - t0 < 300
    for transport in TRANSPORTS:
        assert len(verified_rows(stdout, transport)) == 1, stdout


@pytest.mark.parametrize("example", ["rlhf_nccl_m2n.py", "rlhf_nccl_broadcast.py", "rlhf_ipc_colocate.py"])
def test_example_cpu_mode_verifies(example):
    stdout = run(sys.executable, os.path.join("examples", example), "--cpu")
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(line.endswith("verified") for line in steps), stdout
