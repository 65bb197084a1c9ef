"""Which module may import which: no import cycles, and each package only imports the layers below it.

The rules are data (``LAYERS``): a package named there may import only the packages listed with it,
so a change in a command cannot break training and the SAEs do not depend on anything built on
them (docs/design.md, "Layering rules"). Imports are read from the source with ``ast``, every
statement, also inside functions (a lazy import still ties the modules together); relative imports
and ``from package import module`` resolve to the module they load. A real import is checked too:
a fresh interpreter that imports the training module has loaded no command.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sae_pipeline", "feature_extraction", "benchmarks")  # benchmarks once it is a package

SAE_PIPELINE_TOP = (
    "cli",
    "__main__",
    "evaluate",
    "features",
    "demo",
    "demo_stages",
    "demo_report",
    "cli_args",
    "config_files",
    "resume_checks",
    "run_lock",
)
#: ``{layer: layers it may import}``; a layer is a module or a package (and everything in it): a module belongs to
#: the longest key that names it or one of its packages. A module may always import its own layer and third-party code.
LAYERS: dict[str, tuple[str, ...]] = {
    "feature_extraction": ("feature_extraction",),
    "sae_pipeline": ("feature_extraction",),  # the root package's __init__ (the version), alone: see EXACT
    "sae_pipeline.sae": ("feature_extraction",),
    "sae_pipeline.data": ("sae_pipeline.sae", "feature_extraction"),
    "sae_pipeline.metrics": ("sae_pipeline.sae", "feature_extraction"),
    "sae_pipeline.artifacts": ("sae_pipeline.sae", "sae_pipeline.data", "feature_extraction"),
    "sae_pipeline.figures": ("sae_pipeline.sae", "sae_pipeline.metrics", "feature_extraction"),
    "sae_pipeline.training": (
        "sae_pipeline.sae",
        "sae_pipeline.data",
        "sae_pipeline.metrics",
        "sae_pipeline.figures",
        "sae_pipeline.artifacts",
        "feature_extraction",
    ),
    # The training module reads and writes an SAE through sae/ only, never through the export or predict commands.
    "sae_pipeline.training.module": (
        "sae_pipeline.training.lightning_compat",
        "sae_pipeline.training.non_finite",  # NaN/Inf errors; imports nothing of sae_pipeline
        "sae_pipeline.training.graph_step",  # the step as one CUDA graph; imports nothing of sae_pipeline
        "sae_pipeline.training.optim",  # Adam and its schedule; imports sae/ only
        "sae_pipeline.sae",
        "sae_pipeline.metrics",
        "feature_extraction",
    ),
    # The commands, on top: they may import anything (but still no cycle).
    **{f"sae_pipeline.{name}": ("sae_pipeline", "feature_extraction") for name in SAE_PIPELINE_TOP},
    "benchmarks": ("benchmarks", "sae_pipeline", "feature_extraction"),
}
#: Layers of one module, not of the package below it: a new module of ``sae_pipeline`` must join a layer.
EXACT = ("sae_pipeline",)
#: Modules any layer may import: the root package, whose ``__init__`` holds only ``__version__`` (its rule keeps it so).
SHARED = ("sae_pipeline",)


# --- reading the imports ---
def module_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the ``packages`` (those that are packages) under ``root``."""
    modules: dict[str, Path] = {}
    for package in packages:
        if not (root / package / "__init__.py").is_file():
            continue
        for fpath in sorted((root / package).rglob("*.py")):
            parts = fpath.relative_to(root).with_suffix("").parts
            if not all(part.isidentifier() for part in parts):
                continue  # not importable (e.g. a folder of data with a script in it)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = fpath
    return modules


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (``a.b.func`` -> ``a.b``), None for outside code."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:end])) in modules:
            return prefix
    return None


def imports_of(module: str, modules: Mapping[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module``'s source imports, at module level or inside functions."""
    fpath = modules[module]
    package = module if fpath.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(fpath.read_text(encoding="utf-8"), str(fpath))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: against the package, one level up per extra dot
                parent = package.split(".")
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            # `from pkg import module` loads pkg.module; `from module import name` loads module.
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(target for name in names if (target := _known(name, modules)) is not None)
    found.discard(module)
    return found


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    return {module: imports_of(module, modules) for module in modules}


# --- cycles ---
def _components(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative), each sorted; only those with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
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
    return sorted(found)


def _shortest_cycle(graph: Mapping[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest import path from ``start`` back to itself inside one component (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for child in sorted(graph[node] & within):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in came_from:
                    came_from[child] = node
                    next_frontier.append(child)
        frontier = next_frontier
    raise AssertionError(f"{start} is in no cycle of {sorted(within)}")


def find_cycles(graph: Mapping[str, set[str]]) -> list[str]:
    """Each import cycle as ``a -> b -> a``: in every group of modules that import each other, the shortest
    cycle through each member (a cycle found twice is listed once, from its first module in sorted order)."""
    found = set()
    for component in _components(graph):
        for module in component:
            cycle = _shortest_cycle(graph, module, set(component))[:-1]
            first = cycle.index(min(cycle))
            cycle = cycle[first:] + cycle[:first]
            found.add(" -> ".join([*cycle, cycle[0]]))
    return sorted(found)


# --- layers ---
def _within(module: str, layer: str, exact: Iterable[str] = ()) -> bool:
    return module == layer or (layer not in exact and module.startswith(layer + "."))


def layer_of(module: str, layers: Mapping[str, tuple[str, ...]] = LAYERS, exact: Iterable[str] = EXACT) -> str | None:
    """The longest key of ``layers`` that is ``module`` or one of its packages (an ``exact`` key: only itself)."""
    return max((layer for layer in layers if _within(module, layer, exact)), key=len, default=None)


def layer_violations(
    graph: Mapping[str, set[str]],
    layers: Mapping[str, tuple[str, ...]] = LAYERS,
    exact: Iterable[str] = EXACT,
    shared: Iterable[str] = SHARED,
) -> list[str]:
    """``"module -> module (rule)"`` for each import the rules do not allow; a module of no layer is one too."""
    violations = []
    for module in sorted(graph):
        layer = layer_of(module, layers, exact)
        if layer is None:
            violations.append(f"{module}: in no layer of LAYERS (add its package to the rules)")
            continue
        for target in sorted(graph[module]):
            if (
                target not in shared
                and not _within(target, layer, exact)
                and not any(_within(target, ok) for ok in layers[layer])
            ):
                rule = f"{layer} may import only {', '.join(layers[layer]) or 'itself'}"
                violations.append(f"{module} -> {target} ({rule})")
    return violations


# --- the checker itself: it must be able to fail ---
def _plant(root: Path, files: Mapping[str, str]) -> dict[str, Path]:
    for relpath, text in files.items():
        fpath = root / relpath
        fpath.parent.mkdir(parents=True, exist_ok=True)
        fpath.write_text(text, encoding="utf-8")
    return module_files(root, ["pkg"])


def test_find_cycles_reports_a_planted_two_module_cycle(tmp_path: Path) -> None:
    """``a`` imports ``b`` at the top, ``b`` imports ``a`` inside a function, relatively: a cycle all the same."""
    modules = _plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "",
            "pkg/sub/a.py": "import os\nfrom pkg.sub import b\n",
            "pkg/sub/b.py": "def f():\n    from . import a\n    return a\n",
            "pkg/c.py": "from .sub.a import thing\n",
        },
    )
    graph = import_graph(modules)
    assert graph["pkg.c"] == {"pkg.sub.a"}
    assert find_cycles(graph) == ["pkg.sub.a -> pkg.sub.b -> pkg.sub.a"]


def test_find_cycles_names_a_longer_cycle_and_ignores_a_chain(tmp_path: Path) -> None:
    modules = _plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import pkg.b\n",
            "pkg/b.py": "from ..pkg import c\n",
            "pkg/c.py": "from pkg.a import x as y\n",
            "pkg/d.py": "import pkg.a.x\n",
        },
    )
    assert find_cycles(import_graph(modules)) == ["pkg.a -> pkg.b -> pkg.c -> pkg.a"]
    del modules["pkg.c"]  # a -> b and d -> a: a chain
    assert find_cycles(import_graph(modules)) == []


def test_find_cycles_lists_each_cycle_of_a_tangle(tmp_path: Path) -> None:
    modules = _plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import pkg.b\n",
            "pkg/b.py": "import pkg.a, pkg.c\n",
            "pkg/c.py": "def f():\n    import pkg.b\n",
        },
    )
    assert find_cycles(import_graph(modules)) == ["pkg.a -> pkg.b -> pkg.a", "pkg.b -> pkg.c -> pkg.b"]


def test_layer_violations_names_module_target_and_rule(tmp_path: Path) -> None:
    modules = _plant(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import high\n",
            "pkg/low/__init__.py": "",
            "pkg/high.py": "from . import low\nimport pkg\n",
            "pkg/stray.py": "",
            "pkg/low/x.py": "import pkg.low\ndef f():\n    import pkg.high\n",
        },
    )
    layers = {"pkg": (), "pkg.low": (), "pkg.high": ("pkg.low",)}
    assert layer_violations(import_graph(modules), layers, exact=["pkg"], shared=["pkg"]) == [
        "pkg -> pkg.high (pkg may import only itself)",
        "pkg.low.x -> pkg.high (pkg.low may import only itself)",
        "pkg.stray: in no layer of LAYERS (add its package to the rules)",
    ]
    assert "pkg.high -> pkg (pkg.high may import only pkg.low)" in layer_violations(
        import_graph(modules), layers, exact=["pkg"], shared=[]
    )


# --- the project ---
@pytest.fixture(scope="module")
def project_graph() -> dict[str, set[str]]:
    return import_graph(module_files())


def test_the_graph_sees_the_project(project_graph: dict[str, set[str]]) -> None:
    """The graph is the real one (so an empty list of cycles means something): known edges are in it."""
    assert "sae_pipeline.sae.base" in project_graph["sae_pipeline.sae"]
    assert "sae_pipeline.training.module" in project_graph["sae_pipeline.cli"]
    assert "feature_extraction.shards.layout" in project_graph["feature_extraction.shards.read"]


def test_no_import_cycles(project_graph: dict[str, set[str]]) -> None:
    cycles = find_cycles(project_graph)
    assert not cycles, "import cycles (break each one; imports inside functions count):\n" + "\n".join(cycles)


def test_each_package_imports_only_the_layers_below_it(project_graph: dict[str, set[str]]) -> None:
    violations = layer_violations(project_graph)
    assert not violations, "imports against the layering rules (tests/test_import_rules.py, LAYERS):\n" + "\n".join(
        violations
    )


def test_importing_the_training_module_loads_no_command() -> None:
    """Transitively too: a fresh interpreter that imports ``sae_pipeline.training.module`` has loaded neither the
    export nor the predict writer, nor any command on top (evaluation, feature browser, CLI)."""
    commands = (
        "sae_pipeline.artifacts",
        "sae_pipeline.training.predict",
        *(f"sae_pipeline.{name}" for name in SAE_PIPELINE_TOP),
    )
    code = (
        "import sys, sae_pipeline.training.module\n"
        f"print(' '.join(m for m in sys.modules if m.startswith({commands!r})))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert loaded.split() == []
