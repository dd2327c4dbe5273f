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


@pytest.fixture(autouse=True)
def _replace_dead_peers(request):
    """A test that killed a peer and failed before recovering must not fail every later test."""
    yield
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        if not all(a.alive() for a in c.trainers + c.receivers):
            c.replace_dead()
