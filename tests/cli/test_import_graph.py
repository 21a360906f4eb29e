"""No import circles through the command line: server/ and sim/ never import tokenweir.cli
(not even inside a function), and no chain of imports between packages leads from cli,
server or bench back to itself. Every module under tokenweir/ imports, and importing all of
server/ and sim/ loads no part of the command line."""

from __future__ import annotations

import ast
import functools
import os
import re
import sys
from pathlib import Path

import forkserver  # tests/forkserver.py
import tokenweir

PACKAGE = Path(tokenweir.__file__).parent
ROOT = PACKAGE.parent


@functools.lru_cache(maxsize=None)
def _parse(source: str) -> ast.Module:
    """The tree of `source`, parsed once per process: each test below walks every module of the
    package (~1 CPU-s of parsing per walk), and no walk changes a tree. Keyed by the text, so
    a file that changes (the probe module a test writes) is parsed anew."""
    return ast.parse(source)


def parse(path: Path) -> ast.Module:
    return _parse(path.read_text())


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every tokenweir module `path` imports, at the top or inside a function."""
    name = module_name(path)
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[:len(base) - node.level + 1]
                found.add(".".join(parent + ([node.module] if node.module else [])))
            else:
                found.add(node.module)
    return {m for m in found if m and m.split(".")[0] == "tokenweir"}


def package_of(module: str) -> str:
    """tokenweir.sim.cli -> sim; tokenweir.config -> config; tokenweir -> tokenweir."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def named_modules(path: Path) -> set[str]:
    """Modules named in "tokenweir.module:NAME" strings: the command table's functions and
    the configs' choices_from, which the command line imports when it needs them."""
    return {node.value.partition(":")[0] for node in ast.walk(parse(path))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"tokenweir(\.\w+)+:\w+", node.value)}


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = package_of(module_name(path))
        targets = {package_of(m) for m in imported_modules(path)} - {source}
        graph.setdefault(source, set()).update(targets)
        # the command line resolves these names (tokenweir/cli/flags.py, parser.py)
        named = {package_of(m) for m in named_modules(path)}
        graph.setdefault("cli", set()).update(named - {"cli"})
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def test_server_and_sim_never_import_the_cli():
    offenders = [str(path.relative_to(ROOT)) for folder in ("server", "sim", "bench")
                 for path in (PACKAGE / folder).rglob("*.py")
                 if any(package_of(m) == "cli" for m in imported_modules(path))]
    assert offenders == []


def test_no_package_cycle_passes_through_cli_server_or_bench():
    graph = package_graph()
    assert "sim" in graph["cli"] and "server" in graph["cli"]  # probe: the graph sees edges
    for package in ("cli", "server", "bench"):
        assert not reaches(graph, package, package), package


def test_the_cycle_finder_finds_a_cycle():
    assert reaches({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a", "a")
    assert not reaches({"a": {"b"}, "b": {"c"}}, "a", "a")


def test_every_module_imports_and_server_and_sim_load_no_cli(tmp_path):
    """In a process of its own, forked with the third-party libraries preloaded and no
    tokenweir module (tests/forkserver.py): what is asserted is about tokenweir's modules."""
    modules = sorted(module_name(p) for p in PACKAGE.rglob("*.py")
                     if module_name(p) != "tokenweir.__main__")
    script = (
        "import importlib, sys\n"
        f"modules = {modules!r}\n"
        "first = [m for m in modules if m.startswith(('tokenweir.server', 'tokenweir.sim'))]\n"
        "for m in first: importlib.import_module(m)\n"
        "assert not [m for m in sys.modules if m.startswith('tokenweir.cli')], 'cli loaded'\n"
        "for m in modules: importlib.import_module(m)\n"
        "assert 'tokenweir.cli.parser' in sys.modules\n"  # probe: the loop imported them
        "print(len(modules))\n")
    path = tmp_path / "import_every_module.py"
    path.write_text(script)
    proc = forkserver.run([sys.executable, str(path)], timeout=300, cwd=str(ROOT),
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) == len(modules) > 50


# ---- module-level circles (issue 37) --------------------------------------------------------
# No import circle anywhere in tokenweir, between its modules or between its packages,
# counting imports inside functions (lazy ones) and leaving out `if TYPE_CHECKING:` blocks
# (annotations only: core/sched's phases name the Scheduler they are handed, sim's events and
# disagg the Simulation, without importing them).


def _outside_type_checking(tree: ast.AST):
    """The nodes of `tree`, skipping the bodies of `if TYPE_CHECKING:` (typing-only imports)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                todo.extend(child.orelse)
            else:
                todo.append(child)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The tokenweir modules `path` imports (anywhere but TYPE_CHECKING blocks); `from pkg
    import name` counts as importing pkg.name when that is a module."""
    name = module_name(path)
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in _outside_type_checking(parse(path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parent = base[:len(base) - node.level + 1]
                module = ".".join(parent + ([node.module] if node.module else []))
            subs = {f"{module}.{alias.name}" for alias in node.names} & modules
            found |= subs or {module}
    return (found & modules) - {name}


def module_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: module_imports(p, set(paths)) for m, p in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_lazy_circles_and_skips_type_checking(tmp_path):
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from tokenweir.x import A\n"
              "def f():\n    from tokenweir import y\n")
    path = PACKAGE / "_probe_module_for_test.py"
    path.write_text(source)
    try:
        assert module_imports(path, {"tokenweir.x", "tokenweir.y"}) == {"tokenweir.y"}
    finally:
        path.unlink()


def package_level(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto tokenweir's packages (tokenweir.engine.llm_engine ->
    tokenweir.engine; a top-level module such as tokenweir.config stands for itself)."""
    def fold(module: str) -> str:
        return ".".join(module.split(".")[:2])
    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        folded.setdefault(fold(module), set()).update(
            fold(t) for t in targets if fold(t) != fold(module))
    return folded


def test_no_import_circle_between_any_modules():
    graph = module_graph()
    assert "tokenweir.server.errors" in graph["tokenweir.server.body"]  # probe: edges seen
    assert len(graph) > 100  # probe: the whole package, not a room
    assert circles(graph) == []


def test_no_import_circle_between_packages():
    graph = package_level(module_graph())
    assert "tokenweir.parallel" in graph["tokenweir.engine"]  # probe: folded edges seen
    assert circles(graph) == []


def test_the_circles_that_were_there_would_be_found():
    """Probe: the edges issue 37 removed, put back, make circles again (an import of engine/
    from parallel/worker, as its malloc tuning was: engine <-> parallel; guided/vocab's tokenizer
    import: guided <-> model), and so does a core.sched phase's TYPE_CHECKING import of the
    Scheduler when it is counted."""
    graph = module_graph()
    back = {m: set(t) for m, t in graph.items()}
    back["tokenweir.parallel.worker"].add("tokenweir.engine.llm_engine")
    back["tokenweir.guided.vocab"].add("tokenweir.model.tokenizer")
    assert sorted(circles(package_level(back))) == [["tokenweir.engine", "tokenweir.parallel"],
                                                    ["tokenweir.guided", "tokenweir.model"]]
    back["tokenweir.core.sched.preemption"].add("tokenweir.core.sched.scheduler")
    assert any("tokenweir.core.sched.scheduler" in c for c in circles(back))
