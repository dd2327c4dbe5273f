"""The main job, run exactly as a user runs it."""

import os
import subprocess
import sys

import pytest

from conftest import HAS_VLLM

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]


def test_demo_nccl_2_trainers_tp2_exits_0_and_prints_verified():
    exe = os.path.join(os.path.dirname(sys.executable), "weightsync")
    out = subprocess.run([exe, "demo", "--transport", "nccl", "--trainers", "2", "--tp", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| nccl ")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| verified |"), out.stdout


def test_demo_ipc_2_trainers_tp2_exits_0_and_prints_verified():
    exe = os.path.join(os.path.dirname(sys.executable), "weightsync")
    out = subprocess.run([exe, "demo", "--transport", "ipc", "--trainers", "2", "--tp", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ipc ")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| verified |"), out.stdout
