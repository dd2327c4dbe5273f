"""Every Python and shell block of README.md and docs/*.md is run as written or is a checked fragment (issue 58).

The markers are described in ``tests/doc_blocks.py``. Here: every block carries one; every fragment is an
excerpt of an existing file, line by line in order (so it cannot drift from the code tests run); the
``runs: main`` blocks run as written in this venv; ``runs: ci`` blocks name executable scripts;
``runs: engine`` blocks are left to tests/engine/test_docs.py.
"""

from __future__ import annotations

import os

import pytest

from doc_blocks import ROOT, RUNNERS, Block, all_blocks, code_lines, fragment_problem, page_blocks, run_block

BLOCKS = all_blocks()


def test_every_python_or_shell_block_is_run_or_a_fragment():
    unmarked = [f"{b.id} ({b.lang}): the line before it is {b.marker!r}" for b in BLOCKS
                if b.kind is None or (b.kind[0] == "runs" and b.kind[1] not in RUNNERS)]
    assert not unmarked, ("each ```python/```bash block needs <!-- fragment: path --> or <!-- runs: main|engine|ci -->"
                          " on the line before it:\n" + "\n".join(unmarked))


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind and b.kind[0] == "fragment"], ids=lambda b: b.id)
def test_fragment_is_an_excerpt_of_its_file(block: Block):
    assert fragment_problem(block, block.kind[1]) is None, fragment_problem(block, block.kind[1])


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """A block without a marker is found, and a fragment with a line its file lacks is refused."""
    import doc_blocks

    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nprint(1)\n```\n\n<!-- fragment: pyproject.toml -->\n```bash\nnot there\n```\n")
    monkeypatch.setattr(doc_blocks, "ROOT", str(tmp_path))
    blocks = page_blocks("page.md")
    assert [(b.line, b.lang, b.kind) for b in blocks] == [(3, "python", None),
                                                          (8, "bash", ("fragment", "pyproject.toml"))]
    monkeypatch.setattr(doc_blocks, "ROOT", ROOT)
    assert "'not there' is not in pyproject.toml" in fragment_problem(blocks[1], "pyproject.toml")
    assert "does not exist" in fragment_problem(blocks[1], "no/such/file.py")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == ("runs", "ci")], ids=lambda b: b.id)
def test_ci_block_names_scripts_ci_runs(block: Block):
    for line in code_lines(block):
        script = line.split("#")[0].split()[0]
        assert os.access(os.path.join(ROOT, script), os.X_OK), f"{block.id}: {script} is not an executable script"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == ("runs", "main")], ids=lambda b: b.id)
def test_main_block_runs_as_written(block: Block, tmp_path):
    run_block(block, str(tmp_path), dict(os.environ), timeout_s=600)
