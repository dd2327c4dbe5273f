"""Package structure: no import cycle in src/ (function-level imports count), no module over 1,000 lines
(a backstop: modules are cut by concept) (the package's, and the tests', benchmarks', examples' and
scripts' files) and no function in src/ with a body over 80 lines; no torch object collective (they
pickle) in src/."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_LINES = 1000
MAX_BODY = 80


def _modules() -> dict[str, pathlib.Path]:
    return {".".join(f.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): f for f in SRC.rglob("*.py")}


def _edges(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> modules it imports from, at any depth of the file (lazy imports included).

    As the project's before-stop hook: ``from X import name`` is an edge to ``X.name`` when that is a
    module, else to ``X``; package ``__init__`` modules are not edge targets (re-exports are not cycles).
    """
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.ImportFrom):
                parts = pkg.split(".")
                if n.level:
                    base = ".".join(parts[: len(parts) - n.level + 1] + ([n.module] if n.module else []))
                else:
                    base = n.module or ""
                for a in n.names:
                    for c in (f"{base}.{a.name}", base):
                        if c in mods and c != m and mods[c].name != "__init__.py":
                            edges[m].add(c)
                            break
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name in mods and a.name != m and mods[a.name].name != "__init__.py":
                        edges[m].add(a.name)
    return edges


def _first_cycle(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    found: list[str] = []

    def dfs(u: str, stack: list[str]) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1 and not found:
                found.extend(stack[stack.index(v):] + [v])
            elif not state.get(v):
                dfs(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(edges):
        if not state.get(m):
            dfs(m, [])
    return found


def test_no_import_cycle_in_src():
    cycle = _first_cycle(_edges(_modules()))
    assert not cycle, "import cycle (lazy imports included): " + " -> ".join(cycle)


def test_no_import_cycle_in_benchmarks():
    """The benchmark scripts import each other by file name (``from _baselines import ...``), type-only
    imports included."""
    files = {f.stem: f for f in (ROOT / "benchmarks").glob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    for m, f in files.items():
        for n in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else []
            if isinstance(n, ast.ImportFrom) and not n.level:
                names = [n.module or ""]
            edges[m] |= {x for x in names if x in files and x != m}
    cycle = _first_cycle(edges)
    assert not cycle, "import cycle in benchmarks/: " + " -> ".join(cycle)


def test_the_cycle_check_sees_lazy_imports(tmp_path):
    """The check itself: a function-level import that closes a loop is a cycle."""
    edges = {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": set()}
    assert _first_cycle(edges) == ["p.a", "p.b", "p.a"]
    tree = ast.parse("def f():\n    from weightsync.plan.transfer import TensorSource\n")
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))


def test_no_module_over_1000_lines():
    files = [f for d in ("src", "tests", "benchmarks", "examples", "scripts") for f in (ROOT / d).rglob("*.py")]
    assert len(files) > len(_modules())
    sizes = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in files}
    big = {m: n for m, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``fn``'s body, its docstring aside: from the first statement after it to the end
    (nested functions and classes count in the function that holds them)."""
    body = fn.body
    if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    return fn.end_lineno - body[0].lineno + 1 if body else 0


def _long_functions(source: str, where: str) -> dict[str, int]:
    return {f"{where}:{n.lineno} {n.name}": lines for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and (lines := _body_lines(n)) > MAX_BODY}


def test_no_function_body_over_80_lines():
    long = {}
    for f in SRC.rglob("*.py"):
        long.update(_long_functions(f.read_text(), str(f.relative_to(ROOT))))
    assert not long, f"function bodies over {MAX_BODY} lines (docstring aside): {long}"


def test_the_body_check_counts_code_not_docstrings():
    """The check itself: a long docstring does not count, an 81st line of code does."""
    doc = '    """' + "\n" * 100 + '    """\n'
    assert _long_functions("def f():\n" + doc + "    x = 1\n" * MAX_BODY, "m") == {}
    assert _long_functions("def f():\n" + doc + "    x = 1\n" * (MAX_BODY + 1), "m") == {"m:1 f": MAX_BODY + 1}
    nested = "def outer():\n    def inner():\n" + "        x = 1\n" * MAX_BODY
    assert _long_functions(nested, "m") == {"m:1 outer": MAX_BODY + 1}


def test_plan_is_pure():
    """plan/ imports neither torch nor collectives."""
    for m, f in _modules().items():
        if not m.startswith("weightsync.plan"):
            continue
        for n in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else []
            if isinstance(n, ast.ImportFrom) and not n.level:
                names = [n.module or ""]
            assert not any(x == "torch" or x.startswith(("torch.", "vllm")) for x in names), f"{m} imports {names}"


def test_item_by_item_schedule_lives_only_in_tests():
    """Production cuts rounds once into arrays; the item-by-item listings and cut are the tests' oracle."""
    oracle = {"peer_messages", "pair_messages", "iter_rounds", "items_for_src", "items_for_dst", "iter_items"}
    defined = {f"{f.relative_to(ROOT)}:{n.name}" for f in SRC.rglob("*.py") for n in ast.walk(ast.parse(f.read_text()))
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in oracle}
    assert not defined, f"the item-by-item schedule belongs in tests/oracle.py: {sorted(defined)}"
    assert oracle <= {n.name for n in ast.walk(ast.parse((ROOT / "tests" / "oracle.py").read_text()))
                      if isinstance(n, ast.FunctionDef)}


def test_no_object_collectives_in_src():
    """torch's ``*_object*`` collectives unpickle what a peer sends; ranks share JSON (``share_json``)."""
    pickling = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                "send_object_list", "recv_object_list"}
    used = {f"{f.relative_to(ROOT)}:{n.lineno} {n.attr}" for f in SRC.rglob("*.py")
            for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Attribute) and n.attr in pickling}
    assert not used, used
