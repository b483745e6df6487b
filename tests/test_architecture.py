"""The package's import graph: no cycles, and imports run one way down the layers of docs/architecture.md.

Every ``import`` in ``sapo_megatron/`` counts, including those inside functions and ``TYPE_CHECKING`` blocks: a
cycle hidden in a function body is still a cycle. Edges into a package's ``__init__`` are not counted (importing
``sapo_megatron.rollout.base`` runs ``rollout/__init__`` first, whatever imports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sapo_megatron"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("commands", ("cli", "compare", "conversion.cli", "eval.cli", "eval.report", "plan.cli")),
    ("loop", ("loop",)),
    ("features", ("distill", "eval", "weight_sync", "conversion", "plan")),
    ("engines", ("rollout", "rewards")),
    ("megatron", ("megatron",)),
    (
        "config",
        (
            "config",
            "config_section",
            "defaults",
            "algo.config",
            "data.config",
            "distill.config",
            "eval.config",
            "loop.config",
            "model.config",
            "rollout.config",
            "runtime.config",
        ),
    ),
    ("data", ("data",)),
    ("runtime", ("runtime", "checkpoint")),
    ("base", ("model", "algo", "errors", "_moved", "")),
)
"""Top of the stack first; a module belongs to the layer of its longest matching prefix (relative to the package;
``""`` is the package's own ``__init__``). A module may import its own layer and the layers below it."""


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name relative to the package ("" for its ``__init__``) → file."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _imported_names(module: str, path: Path) -> list[str]:
    """Every dotted name ``module`` imports (absolute, relative to the package when inside it)."""
    is_package = path.name == "__init__.py"
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["sapo_megatron", *filter(None, module.split("."))]
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names += [target] + [f"{target}.{alias.name}" for alias in node.names]
    prefix = "sapo_megatron"
    return [
        n[len(prefix) + 1 :] if n != prefix else ""
        for n in names
        if n == prefix or n.startswith(prefix + ".")
    ]


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the modules of the package it imports (the longest existing prefix of each imported name)."""
    files = module_files(root)
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for module, path in files.items():
        for name in _imported_names(module, path):
            parts = name.split(".") if name else []
            while parts and ".".join(parts) not in files:
                parts.pop()
            target = ".".join(parts)
            if target != module and target in files and target not in packages:
                graph[module].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one cycle through it (a readable path)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_through(graph, set(component)) for component in components]


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A path start → ... → start inside one strongly connected component (breadth-first, so short)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]  # node back to start through the parents, then reversed
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    return sorted(component)


def layer_of(module: str) -> int:
    best, best_len = len(LAYERS), -1
    for position, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = prefix == "" or module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_len:
                best, best_len = position, len(prefix)
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) < layer_of(module):
                found.append(
                    f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                )
    return found


def test_no_import_cycles_and_imports_run_down_the_layers():
    graph = import_graph()
    assert len(graph) > 100 and "loop.trainer" in graph and graph["loop.trainer"]
    assert all(layer_of(module) < len(LAYERS) for module in graph), "every module has a layer"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    assert not upward_imports(graph), "imports against the layers:\n" + "\n".join(upward_imports(graph))


def test_the_check_names_a_cycle_hidden_in_a_function(tmp_path):
    """A throwaway package with a cycle through a function-level import: the check finds it and names it."""
    package = tmp_path / "sapo_megatron"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from sapo_megatron.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from sapo_megatron import c\n")
    (package / "c.py").write_text("from . import a\n")
    (package / "d.py").write_text("import sapo_megatron.a\n")
    graph = import_graph(package)
    assert graph["d"] == {"a"} and graph["sub.b"] == {"c"} and graph["c"] == {"a"}
    assert find_cycles(graph) == [["a", "sub.b", "c", "a"]]
    graph["c"].discard("a")
    assert find_cycles(graph) == []


@pytest.mark.parametrize(
    ("module", "target", "upward"),
    [
        ("algo.losses", "loop.trainer", True),
        ("loop.trainer", "algo.losses", False),
        ("eval.cli", "cli", False),
    ],
)
def test_layers_order(module, target, upward):
    assert bool(upward_imports({module: {target}})) is upward


def test_the_sglang_path_does_not_need_the_cpu_stand_in():
    """Deleting rollout/cpu/ leaves a working SGLang path: no module outside it imports it at module level."""
    files = module_files()
    offenders = []
    for module, path in files.items():
        if module.startswith("rollout.cpu"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only; the engine factories import it in their CPU branch
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "sapo_megatron.rollout.cpu"
            ):
                offenders.append(module)
    assert not offenders, offenders


def test_old_module_names_say_where_they_moved():
    with pytest.raises(
        ModuleNotFoundError, match=r"sapo_megatron\.trainer moved to sapo_megatron\.loop\.trainer"
    ):
        import sapo_megatron.trainer  # noqa: F401
    from sapo_megatron import _moved

    files = module_files()
    assert all(new in files for new in _moved.MOVED.values()) and not any(
        old in files for old in _moved.MOVED
    )


CONFIG_MODULES = [
    module
    for module in module_files()
    if LAYERS[layer_of(module)][0] == "config" and module not in ("config", "defaults")
]


@pytest.mark.slow  # a fresh interpreter each (torch and pydantic load): ~3 s, more on a loaded machine
@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_a_config_module_imports_first_in_a_fresh_interpreter(module):
    """The sections live beside their features and ``config/`` imports them all: whichever is imported first, no
    module finds another half-initialised (an import cycle at run time, which the static graph cannot see)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", f"import sapo_megatron.{module}"],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
