"""Imports only point down: no cycle between attngym's modules, and the library never imports the
run layer (tasks, tracking, the CLI, config), Hydra/OmegaConf or wandb.

The graph is read from the source with `ast`, every import counted, including the ones inside
functions (a lazy import is still a dependency, only a later one).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "attngym"

# The layers are folders: attngym/runner/ is the run layer (Hydra, the tasks, tracking, the
# launchers); the rest of attngym/ is the library, what a notebook imports to attend, validate and
# time without the run layer. The package's entry points open the run layer lazily.
RUN_LAYER = ("attngym.runner", "hydra", "omegaconf", "wandb")
ENTRY_POINTS = ("attngym", "attngym.__main__")


def module_names() -> dict[str, Path]:
    """{dotted module name: file} of every attngym module (a package is its __init__.py)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules `name` imports: attngym modules by their dotted name, others by their top
    package (hydra, omegaconf, torch, ...)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "attngym":
                found.add(target.split(".")[0])
                continue
            while target not in modules:  # `import attngym.x.y` of a name: its module
                target = target.rpartition(".")[0]
            if target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among attngym modules as a path [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "attngym.variants.base" in graph["attngym.kernels"]
    assert "attngym.runner.tracking.files" in graph["attngym.runner.tracking.sweep"]
    assert (
        "attngym.registry" in graph["attngym.runner.config.settings"]
    )  # imported inside a function
    assert (
        "hydra" in graph["attngym.runner.cli"] and "omegaconf" in graph["attngym.runner.overrides"]
    )


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_library_never_imports_the_run_layer():
    graph = import_graph()
    library = [m for m in graph if not _within(m, RUN_LAYER) and m not in ENTRY_POINTS]
    assert "attngym.validation" in library and "attngym.variants.spec" in library
    bad = {
        module: sorted(t for t in targets if _within(t, RUN_LAYER))
        for module, targets in graph.items()
        if module in library
    }
    assert not {m: t for m, t in bad.items() if t}, bad


def test_tracking_reads_the_metric_schema_not_tasks():
    graph = import_graph()
    for module, targets in graph.items():
        if _within(module, ("attngym.runner.tracking",)):
            assert not any(_within(t, ("attngym.runner.tasks",)) for t in targets), module


def test_config_imports_nothing_from_distributed():
    """What the config knows of a topology it asks the topology's spec, through attngym.registry
    (lazy imports counted too)."""
    graph = import_graph()
    package = [
        m for m in graph if _within(m, ("attngym.runner.config",))
    ]  # the package and its modules
    assert "attngym.runner.config.topology" in package
    imported = set().union(*(graph[m] for m in package))
    assert not [m for m in imported if _within(m, ("attngym.distributed",))], sorted(imported)
