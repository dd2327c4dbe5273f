"""The fenced Python and shell blocks of README.md and docs/*.md, and the marker each must carry (issue 58).

The line right before a ```python / ```py / ```bash / ```sh / ```shell / ```console fence is one of

* ``<!-- fragment: path/in/repo -->``: the block is an excerpt of that file, which tests run; its non-blank
  lines (stripped; a console block's ``$`` prompts dropped) occur in the file in this order;
* ``<!-- runs: main -->``: tests/test_docs.py runs it as written in .venv (Python in a fresh interpreter,
  shell with bash, both from the repository root);
* ``<!-- runs: engine -->``: tests/engine/test_docs.py runs it in .venv-engine (blocks that start engines);
* ``<!-- runs: ci -->``: the block's commands are scripts CI runs itself (``.ci/run`` runs scripts/test.sh,
  tests/engine/test_examples.py the demo of scripts/demo.sh): each is an executable script of the repository.

Blocks of other languages (text, json, toml, ...) are not code and need no marker.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_LANGS = frozenset({"python", "py", "bash", "sh", "shell", "console"})
PYTHON_LANGS = frozenset({"python", "py"})
MARKER = re.compile(r"<!-- (fragment|runs): (\S+) -->")
RUNNERS = ("main", "engine", "ci")
FENCE = re.compile(r"^ {0,3}```\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # the opening fence's line, from 1
    lang: str
    code: str
    marker: str  # the line before the fence, stripped

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> tuple[str, str] | None:
        """("fragment", path) or ("runs", main|engine|ci); None without a marker."""
        m = MARKER.fullmatch(self.marker)
        return (m.group(1), m.group(2)) if m else None

    @property
    def is_python(self) -> bool:
        return self.lang in PYTHON_LANGS


def pages() -> list[str]:
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md", *(os.path.join("docs", f) for f in docs)]


def page_blocks(page: str) -> list[Block]:
    """Every fenced block of ``page`` in a code language (Python or shell)."""
    with open(os.path.join(ROOT, page)) as f:
        lines = f.read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page}:{i + 1}: a fence that never closes"
        if m.group(1).lower() in CODE_LANGS:
            marker = lines[i - 1].strip() if i else ""
            out.append(Block(page, i + 1, m.group(1).lower(), "\n".join(lines[i + 1:end]) + "\n", marker))
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in page_blocks(page)]


def code_lines(block: Block) -> list[str]:
    """The block's non-blank lines, stripped (a console block's ``$`` prompt dropped)."""
    lines = [ln.strip() for ln in block.code.splitlines() if ln.strip()]
    return [ln[2:] if block.lang == "console" and ln.startswith("$ ") else ln for ln in lines]


def fragment_problem(block: Block, path: str) -> str | None:
    """Why ``block`` is not an excerpt of ``path`` (None when it is): the file is missing, or a line of the
    block is not in it after the previous one."""
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):
        return f"{block.id}: its fragment marker names {path}, which does not exist"
    with open(full) as f:
        source = [ln.strip() for ln in f.read().splitlines()]
    at = 0
    for line in code_lines(block):
        try:
            at = source.index(line, at) + 1
        except ValueError:
            return f"{block.id}: the line {line!r} is not in {path} (after the block's previous lines)"
    return None


def run_block(block: Block, workdir: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``block`` as written from the repository root: Python in a fresh interpreter (this one's venv),
    shell in bash; this venv's ``python`` first on PATH. Asserts it holds no ``...`` and exits 0."""
    assert "..." not in block.code, f"{block.id}: a block that runs has no `...`"
    env = dict(env, PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    if block.is_python:
        script = os.path.join(workdir, "block.py")
        with open(script, "w") as f:
            f.write(block.code)
        cmd = [sys.executable, script]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc
