"""Shared fixtures. The local cluster (trainer + vLLM receiver processes) starts once per session:
each vLLM process costs seconds to import."""

from __future__ import annotations

import importlib.util

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def cluster():
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (pip install -e '.[vllm,test]')")
    from weightsync.testing.cluster import LocalCluster

    c = LocalCluster()
    yield c
    c.close()
