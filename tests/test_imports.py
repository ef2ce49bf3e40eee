"""The import graph of `tpuray` has no circle but the two known, harmless ones.

Read from the source with `ast` (nothing is imported): an edge A -> B for every `import B` / `from B
import x` in module A, module-level or inside a function (a lazy import still ties the two modules
together), `if TYPE_CHECKING:` ones included (they tie the modules' designs together as much). `from pkg
import sub` points at `pkg.sub` when it is a module. The emulated `torch_tpu` shim (tpuray/emulator/
torch_tpu_shim, put on the import path of emulated hosts) counts under its import name, `torch_tpu`. A
circle is a strongly connected component of more than one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

SHIM = SRC / "tpuray" / "emulator" / "torch_tpu_shim"

# The two known, harmless circles: the emulated cluster starts its preemption helper, which names the
# cluster's type; the torch_tpu shim loads tpuray.runtime, which imports torch_tpu (the shim, emulated).
ALLOWED = [
    {"tpuray.emulator.cluster", "tpuray.emulator.preemption"},
    {"torch_tpu", "tpuray.runtime"},  # and modules of either package
]
# Circles still to be broken (issue 21), each allowed exactly as it is until then: remove them as they go.
PENDING: list[set[str]] = []  # circles known but not yet broken (none left)


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "tpuray").rglob("*.py"):
        root = SHIM if path.is_relative_to(SHIM) else SRC
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST, name: str, is_pkg: bool, known: set[str]) -> set[str]:
    found: set[str] = set()
    package = name if is_pkg else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = _imports(tree, name, path.name == "__init__.py", known)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def _allowed(component: set[str]) -> bool:
    if component in PENDING:
        return True
    for allowed in ALLOWED:
        if component == allowed:
            return True
        if all(any(m == a or m.startswith(a + ".") for a in allowed) for m in component):
            return True
    return False


def test_no_new_import_circle() -> None:
    found = circles(import_graph())
    bad = [sorted(c) for c in found if not _allowed(c)]
    assert not bad, f"import circle(s) among tpuray modules: {bad}"


def test_the_checker_sees_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
