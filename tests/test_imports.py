"""Imports point one way: edgetune (base) < hwprobe < kernels < tuner < daemon < fleet, and no cycles.

Read from the source (ast), not from what happens to be imported at run time, so an import inside a function
counts as much as one at the top. `from pkg import name` is an import of `pkg.name` when that is a module, else of
`pkg` (as import-linter reads it). Tests and bench/ may import anything. The base reaches the packages above it
only through the module names they register by (edgetune.main's VERB_MODULES, edgetune.config's SECTION_MODULES),
loaded by name at run time, as plugins are: no base module depends on their code.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS = ["edgetune", "hwprobe", "kernels", "tuner", "daemon", "fleet"]  # each may import only those before it
FORBIDDEN = {("fleet", "daemon")}  # the fleet talks to devices through the wire protocol, never their code


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for layer in LAYERS for p in (REPO / layer).rglob("*.py")}
    assert len(found) > 50 and all(layer in found for layer in LAYERS), sorted(found)
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The repo modules `name` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_packages_import_only_packages_below_them() -> None:
    bad = []
    for mod, deps in graph().items():
        layer = mod.split(".")[0]
        for dep in sorted(deps):
            other = dep.split(".")[0]
            if LAYERS.index(other) > LAYERS.index(layer) or (layer, other) in FORBIDDEN:
                bad.append(f"{mod} imports {dep}")
    assert not bad, "imports against the layer order " + " < ".join(LAYERS) + ":\n  " + "\n  ".join(bad)


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None. Iterative DFS, three colours."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(g):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(g[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(g[nxt])))
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walk_sees_lazy_and_relative_imports(tmp_path) -> None:
    """The checks above can fail: an import inside a function is an edge, and a planted cycle is found."""
    known = {"a": tmp_path / "a.py", "b": tmp_path / "b.py", "a.c": tmp_path / "c.py"}
    known["a"].write_text("def f():\n    import b\n")
    known["b"].write_text("from a import c, x\n")
    assert imports_of("a", known["a"], known) == {"b"}
    assert imports_of("b", known["b"], known) == {"a.c", "a"}
    assert find_cycle({"a": {"b"}, "b": {"a.c", "a"}, "a.c": set()}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
