"""The layout is the architecture: the runtime packages' import graph, read from their source,
has no cycles, every coordinator subpackage imports only the layers below it, and the
coordinator's top level stays small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ("expertmesh", "coordinator", "gpu_server", "cpu_expert_server")

# NOTE: the coordinator's subsystems, bottom to top: a package may import its own modules and
# those of the layers listed before it, never one listed after it. A type-only import
# (under TYPE_CHECKING) may point upwards, e.g. the engine names the LoRA manager's type; it
# still counts for cycles.
COORDINATOR_LAYERS = ("model", "experts", "eplb", "lora", "config", "serving")
# the entry points, which assemble the layers (the coordinator; its kernel compile helper)
COORDINATOR_TOP = {"main", "compile_helper"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in RUNTIME:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            if "_pb2" in name:  # generated protobuf code: imports only its own messages
                continue
            mods[name] = path
    return mods


def _imported(
    node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool, mods: dict[str, Path]
) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_pkg else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def _type_checking_nodes(tree: ast.Module) -> set[ast.AST]:
    """The import statements under ``if TYPE_CHECKING:`` (type-only edges)."""
    out: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(n for stmt in node.body for n in ast.walk(stmt))
    return out


def import_graph(type_only: bool = True) -> dict[str, set[str]]:
    """module -> the runtime modules it imports anywhere in its source (function bodies
    included; ``if TYPE_CHECKING:`` blocks unless ``type_only`` is False). ``from pkg import
    name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``; importing
    ``a.b.c`` also runs ``a`` and ``a.b``, which is not counted (a package's ``__init__`` is its
    own node)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = set() if type_only else _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or node in skip:
                continue
            for target in _imported(node, name, path.name == "__init__.py", mods):
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same node, else None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_find_cycle_reports_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_runtime_packages_have_no_import_cycle() -> None:
    graph = import_graph()
    assert "coordinator.serving.server" in graph, sorted(graph)[:10]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "coordinator" or len(parts) < 2:
        return None
    return parts[1]


def test_coordinator_layers_import_only_downwards() -> None:
    rank = {name: i for i, name in enumerate(COORDINATOR_LAYERS)}
    wrong = []
    for module, deps in import_graph(type_only=False).items():
        here = _layer(module)
        if here is None or here in COORDINATOR_TOP:
            continue
        assert here in rank, f"coordinator/{here} is neither a layer nor a top-level module"
        for dep in deps:
            there = _layer(dep)
            if there is None or there == here:
                continue
            if there in COORDINATOR_TOP or rank[there] > rank[here]:
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_coordinator_top_level_is_small_and_every_subpackage_says_what_it_holds() -> None:
    top = ROOT / "coordinator"
    modules = sorted(p.name for p in top.glob("*.py"))
    assert len(modules) <= 8, modules
    for pkg in sorted(p for p in top.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(pkg.read_text()))
        assert doc and len(doc.split()) >= 12, f"{pkg.relative_to(ROOT)} needs a docstring paragraph"
    for layer in COORDINATOR_LAYERS:
        if layer == "config":
            continue
        doc = ast.get_docstring(ast.parse((top / layer / "__init__.py").read_text())) or ""
        assert "import" in doc, f"coordinator/{layer}/__init__.py must say what it may import"


@pytest.mark.parametrize("pkg", RUNTIME)
def test_runtime_packages_compile(pkg: str) -> None:
    import compileall

    assert compileall.compile_dir(str(ROOT / pkg), quiet=1, force=False)
