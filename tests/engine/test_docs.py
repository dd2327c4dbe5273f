"""The ``runs: engine`` blocks of README.md and docs/*.md, run as written in .venv-engine (issue 58).

The markers are described in ``tests/doc_blocks.py`` (tests/test_docs.py checks that every block has one
and that fragments match their files). A block here runs in a fresh interpreter (Python) or bash (shell)
from the repository root, with this venv's ``python`` first on PATH and a user's environment (no ``VLLM_``
or ``RAY_`` variables from the test run). A page whose block a dedicated test runs with more checks is
listed in ``OWN_TESTS``: the block is run there, not twice.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: doc_blocks
from doc_blocks import Block, all_blocks, run_block  # noqa: E402

pytestmark = pytest.mark.timeout(900)

BLOCKS = [b for b in all_blocks() if b.kind == ("runs", "engine")]
OWN_TESTS = {"docs/first_script.md": "test_first_script.py"}
"""page -> the test in tests/engine that runs its ``runs: engine`` block (with checks of its output)."""


def test_pages_with_their_own_test_are_run_there():
    for page, test in OWN_TESTS.items():
        assert any(b.page == page for b in BLOCKS), f"{page} has no runs: engine block"
        with open(os.path.join(HERE, test)) as f:
            assert f'engine_blocks("{page}")' in f.read(), f"{test} does not run {page}'s block"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.page not in OWN_TESTS], ids=lambda b: b.id)
def test_engine_block_runs_as_written(block: Block, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VLLM_"))}
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a limit
    run_block(block, str(tmp_path), env, timeout_s=850)
