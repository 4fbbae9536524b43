"""Imports run one way: no module of areal_hpc/ imports one that imports it back, directly or
through others. Every import counts: at module level, inside functions (one that only hides a circle is
still a circle) and under `if TYPE_CHECKING:` (a type a module needs is a dependency all the same); and
importing a package's module from outside the package runs the package's __init__ first, so that counts
as an import of the package too. Shared error types and helpers live in leaf modules (areal_hpc/errors.py,
areal_hpc/launch/errors.py, areal_hpc/exit_codes.py) for that reason. One level up, the packages (the wings:
controller/, trainer/, config/, ...) import one way too: no two of them import each other, through any of
their modules."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("areal_hpc",)


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, a package by its __init__.py."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node at any depth: module level, in functions, under TYPE_CHECKING."""
    return (node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom))


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (`from pkg import mod` is an edge to pkg.mod). Importing a
    package's module from outside that package runs the package's __init__ first: an edge to the package
    too (a module inside the package is imported as part of it, so its own imports of siblings are not)."""

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        deps = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names}
                continue
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base) for a in node.names}
        deps -= {None, module}
        graph[module] = deps | {
            parent for dep in deps for parent in _parents(dep, files) if not _inside(module, parent)
        }
    return graph


def _parents(module: str, files: dict[str, Path]) -> list[str]:
    """The project packages above `module` (areal_hpc.config for areal_hpc.config.schema)."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in files]


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_project_imports_have_no_circle():
    graph = import_graph(module_files(REPO))
    # the walk sees the project: a package's submodules, a TYPE_CHECKING import, a package's __init__
    assert len(graph) > 40 and "areal_hpc.arch" in graph["areal_hpc.config.validate"]
    assert {"areal_hpc.config.schema", "areal_hpc.config"} <= graph["areal_hpc.layout"]
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def package_of(module: str, files: dict[str, Path]) -> str | None:
    """The project's sub-package a module belongs to (areal_hpc.trainer for areal_hpc.trainer.engine; the
    first level below areal_hpc), or None for a module at the top (areal_hpc.cli)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    first = ".".join(parts[:2])
    return first if files[first].name == "__init__.py" else None


def package_pairs(graph: dict[str, set[str]], files: dict[str, Path]) -> list[tuple[str, str]]:
    """Each pair of packages (a, b), a < b, where a module of a imports one of b and a module of b one of a."""
    edges = {(package_of(m, files), package_of(d, files)) for m, deps in graph.items() for d in deps}
    edges = {(a, b) for a, b in edges if a and b and a != b}
    return sorted((a, b) for a, b in edges if a < b and (b, a) in edges)


def test_no_two_packages_import_each_other():
    files = module_files(REPO)
    pairs = package_pairs(import_graph(files), files)
    assert {package_of(m, files) for m in files} >= {"areal_hpc.trainer", "areal_hpc.config", "areal_hpc.launch"}
    assert pairs == [], "packages that import each other: " + ", ".join(f"{a} <-> {b}" for a, b in pairs)


def test_a_pair_of_packages_importing_each_other_is_found(tmp_path):
    pkg = tmp_path / "areal_hpc"
    for sub in ("p", "q"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("from areal_hpc.p import a\n")
    (pkg / "p" / "a.py").write_text("from areal_hpc.q import b\n")
    (pkg / "q" / "b.py").write_text("")
    (pkg / "q" / "c.py").write_text("from areal_hpc import top\n")  # a top-level module is no package
    files = module_files(tmp_path, ("areal_hpc",))
    assert package_pairs(import_graph(files), files) == []
    (pkg / "q" / "c.py").write_text("def f():\n    from areal_hpc.p import a\n")  # no module circle: c -> a -> b
    graph = import_graph(files)
    assert find_cycle(graph) is None
    assert package_pairs(graph, files) == [("areal_hpc.p", "areal_hpc.q")]


def test_a_function_level_or_type_checking_import_that_closes_a_circle_is_found(tmp_path):
    pkg = tmp_path / "areal_hpc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from areal_hpc import c\n")
    (pkg / "b.py").write_text("from areal_hpc import a\nfrom .sub import d\n")
    (pkg / "c.py").write_text("from areal_hpc import a\n")
    (pkg / "sub" / "d.py").write_text("def f():\n    from ..b import g\n")
    graph = import_graph(module_files(tmp_path, ("areal_hpc",)))
    assert graph["areal_hpc.a"] == {"areal_hpc.c"}, "a TYPE_CHECKING import counts"
    assert graph["areal_hpc.b"] == {"areal_hpc.a", "areal_hpc.sub.d", "areal_hpc.sub"}
    assert find_cycle(graph) == ["areal_hpc.a", "areal_hpc.c", "areal_hpc.a"]
    (pkg / "c.py").write_text("")
    graph = import_graph(module_files(tmp_path, ("areal_hpc",)))
    assert find_cycle(graph) == ["areal_hpc.b", "areal_hpc.sub.d", "areal_hpc.b"]
    # through a package's __init__: c imports sub.e from outside sub, whose __init__ imports c
    (pkg / "sub" / "d.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from areal_hpc import c\n")
    (pkg / "sub" / "e.py").write_text("")
    (pkg / "c.py").write_text("from areal_hpc.sub import e\n")
    graph = import_graph(module_files(tmp_path, ("areal_hpc",)))
    assert graph["areal_hpc.c"] == {"areal_hpc.sub.e", "areal_hpc.sub"}
    assert find_cycle(graph) == ["areal_hpc.c", "areal_hpc.sub", "areal_hpc.c"]
