"""The house's shape: the import graph of the package's files has no circle, and no file of
``ulacache_vllm/`` is over 500 lines.

The graph is read from the source with `ast` (nothing is imported): every import counts, at the
top of a file, inside a function (lazy) or under ``if TYPE_CHECKING:`` (type-only). Files are
``ulacache_vllm/**.py`` plus the two packages setup.cfg maps from elsewhere, ``patches/``
(``ulacache_vllm.patches``) and ``kernels/`` (``ulacache_vllm.kernels``).

Edges, one per imported module of ours:

* ``import a.b.c`` and ``from a.b import c`` where ``a/b/c`` is a module or a package: an edge
  to that module's file (a package's ``__init__.py``); ``from a.b import name`` where ``name``
  is not a submodule: an edge to ``a/b/__init__.py`` (the package's namespace). Relative
  imports are resolved against the importing file's package.
* Importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``; those implicit
  parents are not edges (otherwise every package that re-exports a submodule would close a
  circle with each of its submodules). An ``__init__.py`` that imports a submodule and a
  submodule that imports from its package's ``__init__.py`` (``from . import NAME``) are both
  edges, so that pair is reported as the circle it is.
* An import of the importing file itself (``from . import x`` naming a name of the same
  ``__init__.py``) is not an edge.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500
# package name -> its directory (setup.cfg: packages + package_dir)
PACKAGE_DIRS = {
    "ulacache_vllm": ROOT / "ulacache_vllm",
    "ulacache_vllm.patches": ROOT / "patches",
    "ulacache_vllm.kernels": ROOT / "kernels",
}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (``__init__.py`` as the
    package's own name)."""
    out: dict[str, Path] = {}
    for base, d in PACKAGE_DIRS.items():
        for f in sorted(d.rglob("*.py")):
            rel = f.relative_to(d).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            # A mapped sub-directory (ulacache_vllm/patches would shadow patches/): skip.
            name = ".".join([base, *parts])
            if base == "ulacache_vllm" and parts and f"ulacache_vllm.{parts[0]}" in PACKAGE_DIRS:
                continue
            out[name] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that file ``path`` (module ``name``) imports (module doc)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    out.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif target in modules:
                    out.add(target)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component with more than one file (Tarjan), as a
    path ``a -> b -> ... -> a``; the whole component's files are listed after it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # recursive: the graph is small
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
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
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    out = []
    for comp in comps:
        members = set(comp)
        # A shortest circle through the component's first file (breadth-first).
        start = comp[0]
        prev: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        found = v
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v != start:
            path.append(v)
            v = prev[v]
        path.append(start)
        path = [path[0]] + path[1:-1][::-1] + [start]
        out.append(path + ["(component: " + ", ".join(comp) + ")"])
    return out


def test_the_checker_sees_lazy_type_only_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom . import c\nimport os\n")
    monkeypatch.setitem(PACKAGE_DIRS, "pkg", pkg)
    for k in [k for k in PACKAGE_DIRS if k != "pkg"]:
        monkeypatch.delitem(PACKAGE_DIRS, k)
    g = import_graph()
    assert g == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c"},
                 "pkg.sub": set(), "pkg.sub.c": {"pkg.a"}}
    (found,) = cycles(g)
    assert found[:4] == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]


def test_the_import_graph_of_the_package_has_no_circle():
    graph = import_graph()
    assert len(graph) > 50  # the package was found
    found = cycles(graph)
    assert not found, "import circles (lazy and type-only imports count):\n" + "\n".join(
        " -> ".join(c[:-1]) + "\n    " + c[-1] for c in found)


def test_no_file_of_the_package_is_over_500_lines():
    long = {str(f.relative_to(ROOT)): n for f in sorted((ROOT / "ulacache_vllm").rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
