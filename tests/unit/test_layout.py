"""The package's layering, checked on the source (ast; nothing is imported).

The rules (README, "Architecture"):
  * symphony/engine/ imports nothing from kernel, kvfs, ipc, lip or the CLI/client: the
    engine takes steps and page tables; it does not know who asks.  (tokenizer and sched,
    whose Step it runs, are allowed.)
  * symphony/lip/ (code that runs inside a LIP) imports from symphony only ipc, tokenizer and
    itself, and nothing it imports, directly or through those, imports torch.
  * symphony/ipc/ (the ABI both sides share) imports from symphony only itself.
  * symphony/tokenizer.py imports nothing from symphony and no torch.
  * nothing imports symphony.kernel except symphony/kernel/ itself and the command line that
    starts it (symphony/cli.py, symphony/kernel_cli.py).
  * the stock programs (userland/*.py) import from symphony only the symphony.lip package: what a
    LIP is given to program with.
  * symphony/gateway/ (the HTTP front door, a process of its own) imports from symphony only
    itself, ipc (the kernel's socket protocol) and programs, and no torch: it does no model work;
    symphony/remote.py (the HTTP client of `symphony run --remote`) imports nothing of symphony.
  * no module of symphony/ imports, directly or round about, a module that imports it back.
  * no file under symphony/ is over 500 lines.
Imports inside functions and under ``if TYPE_CHECKING`` count like any other.  This is the
project's one test of its import rules.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "symphony"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_statements(path: Path):
    """(module, names) of each import statement in ``path``, wherever it stands, relative
    imports resolved: ``import X`` -> (X, []), ``from X import y, z`` -> (X, [y, z])."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    mod = _module_name(path) if path.is_relative_to(PKG) else path.stem
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                if not base or node.level - 1 > len(package.split(".")):
                    raise AssertionError(f"{path}: relative import above the package")
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            yield base_name, [a.name for a in node.names if a.name != "*"]


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports (absolute; for ``from X import y``, both X and X.y,
    since y may be a submodule)."""
    out: set[str] = set()
    for base, names in _import_statements(path):
        out.add(base)
        out.update(f"{base}.{n}" for n in names)
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _files(sub: str = "") -> list[Path]:
    root = PKG / sub if sub else PKG
    return [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))


def _modules() -> dict[str, Path]:
    """Every module of the package, by name."""
    return {_module_name(f): f for f in _files()}


def _edges(path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of the package ``path`` imports.  ``from X import y`` counts as X.y where that
    is a module, as X otherwise (a name X's ``__init__`` defines or re-exports); ``import X.Y``
    as X.Y (its parent packages run first, but it needs nothing of them).  So a submodule's
    ``from . import sibling`` is an edge to the sibling, not to its package, and a package whose
    ``__init__`` imports its own submodules is no cycle; a submodule taking a name from its
    package's ``__init__`` that imports it back is one."""
    out = set()
    for base, names in _import_statements(path):
        out.update({f"{base}.{n}" if f"{base}.{n}" in mods else base for n in names} if names else {base})
    return {m for m in out if m in mods and m != _module_name(path)}


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (`_edges`)."""
    mods = _modules()
    return {name: _edges(path, mods) for name, path in mods.items()}


def import_cycles(graph=None) -> list[list[str]]:
    """The import cycles of ``graph``: each strongly connected component of more than one module
    (Tarjan's algorithm), sorted."""
    graph = import_graph() if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _violations(files, forbidden) -> list[str]:
    return [f"{f.relative_to(REPO)} imports {name}" for f in files for name in sorted(_imports(f))
            if forbidden(name)]


def test_engine_imports_nothing_from_the_os_ipc_or_lip_layers():
    banned = ("symphony.kernel", "symphony.kvfs", "symphony.ipc", "symphony.lip", "symphony.cli",
              "symphony.kernel_cli", "symphony.client", "symphony.programs")
    assert _violations(_files("engine"), lambda n: any(_under(n, b) for b in banned)) == []


def test_lip_imports_only_ipc_tokenizer_and_itself():
    allowed = ("symphony.lip", "symphony.ipc", "symphony.tokenizer")
    assert _violations(_files("lip"), lambda n: _under(n, "symphony")
                       and n != "symphony" and not any(_under(n, a) for a in allowed)) == []


def test_no_torch_in_what_a_lip_imports():
    """The closure of symphony modules a LIP may import (every module of symphony/lip/ and the
    tokenizer, their package __init__s included) imports no torch: a LIP process never loads it."""
    todo = [_module_name(f) for f in _files("lip")] + ["symphony.tokenizer"]
    seen, torchy = set(), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        rel = Path(*name.split("."))
        path = next((p for p in (REPO / rel / "__init__.py", REPO / rel.with_suffix(".py")) if p.is_file()), None)
        if path is None:                           # an attribute (from X import y), not a module
            continue
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]          # parent packages run first
        for imp in _imports(path):
            if _under(imp, "symphony"):
                todo.append(imp)
            elif _under(imp, "torch"):
                torchy.append(f"{path.relative_to(REPO)} imports {imp}")
    assert "symphony.ipc" in seen and "symphony.lip.runtime" in seen    # the walk did reach them
    assert torchy == []


def test_ipc_imports_only_itself():
    assert _violations(_files("ipc"), lambda n: _under(n, "symphony") and n != "symphony"
                       and not _under(n, "symphony.ipc")) == []


def test_tokenizer_imports_no_torch_and_nothing_of_symphony():
    assert _violations(_files("tokenizer.py"), lambda n: _under(n, "torch") or _under(n, "symphony")) == []


def test_only_the_command_line_imports_the_kernel():
    cli = {PKG / "cli.py", PKG / "kernel_cli.py"}
    files = [f for f in _files() if f not in cli and not f.is_relative_to(PKG / "kernel")]
    assert _violations(files, lambda n: _under(n, "symphony.kernel")) == []


def test_stock_programs_import_only_the_lip_library():
    files = sorted((REPO / "userland").glob("*.py"))
    assert files
    assert _violations(files, lambda n: _under(n, "symphony") and not _under(n, "symphony.lip")) == []


def test_gateway_imports_only_ipc_programs_and_itself_and_no_torch():
    allowed = ("symphony.gateway", "symphony.ipc", "symphony.programs")
    assert _violations(_files("gateway"), lambda n: _under(n, "torch") or (
        _under(n, "symphony") and n != "symphony" and not any(_under(n, a) for a in allowed))) == []
    assert _violations(_files("remote.py"), lambda n: _under(n, "symphony") or _under(n, "torch")) == []


def test_the_rules_see_what_they_check():
    """The checker itself: it resolves relative imports, counts imports inside functions, and
    would catch a violation (a test that cannot fail checks nothing)."""
    imps = _imports(PKG / "cli.py")
    assert "symphony.client" in imps                        # `from .client import ...` inside a function
    assert _under("symphony.kernel.daemon", "symphony.kernel") and not _under("symphony.kernelx", "symphony.kernel")
    assert any(_under(n, "symphony.kernel") for n in _imports(PKG / "kernel_cli.py"))
    engine = _imports(PKG / "engine" / "model.py")
    assert "symphony.engine" in engine and all(_under(n, "symphony.engine") or not _under(n, "symphony")
                                               for n in engine if n.startswith("symphony"))
    assert sys.version_info >= (3, 9)                       # Path.is_relative_to


def test_no_import_cycle_among_the_modules():
    """No module imports, directly or round about, a module that imports it back: every
    strongly connected component of the import graph is one module."""
    graph = import_graph()
    assert {"symphony.cli", "symphony.ipc.kernel_side", "symphony.kvfs.fs"} <= graph.keys()
    assert "symphony.ipc.wait" in graph["symphony.ipc.kernel_side"]       # the graph sees imports
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set(), "c": {"d"}, "d": {"c"}}) == [["c", "d"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}}) == []


def test_no_file_under_symphony_is_over_500_lines():
    long = {str(f.relative_to(REPO)): n for f in _files()
            if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}
