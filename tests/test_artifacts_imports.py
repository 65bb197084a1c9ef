"""``sae_pipeline.artifacts`` sits above the SAEs and the data and below training and the commands.

Its modules import nothing in a cycle (the native export and SAELens's format share
``export_files``/``checkpoint`` below both, and neither imports the other), and nothing above them:
only ``sae_pipeline.sae``, ``sae_pipeline.data``, ``feature_extraction``, each other and the
package's version. Every import statement counts, those inside functions too.
"""
from __future__ import annotations

from pathlib import Path

from test_import_rules import PACKAGE_DPATH, imported_modules

ARTIFACTS_DPATH = PACKAGE_DPATH / "artifacts"
ALLOWED = ("sae_pipeline.sae", "sae_pipeline.data", "sae_pipeline.artifacts", "feature_extraction")
# The export command's --help formatter: a leaf module of command plumbing (it imports only jsonargparse).
PLUMBING = ("sae_pipeline.help_format",)


def module_name(fpath: Path) -> str:
    return ".".join(fpath.relative_to(PACKAGE_DPATH.parent).with_suffix("").parts).removesuffix(".__init__")


def artifacts_imports() -> dict[str, set[str]]:
    """``{module: the artifacts modules it imports}`` over sae_pipeline/artifacts/ (``from package import module``
    resolved to the module)."""
    modules = {module_name(fpath): fpath for fpath in sorted(ARTIFACTS_DPATH.glob("*.py"))}
    return {name: {other for other in modules if other in imported_modules(fpath) and other != name}
            for name, fpath in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle through a module of ``graph`` (``{module: modules it imports}``), as ``a -> b -> a``."""
    cycles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return cycles


def test_artifacts_modules_import_no_cycle() -> None:
    graph = {name: edges - {"sae_pipeline.artifacts"} for name, edges in artifacts_imports().items()
             if name != "sae_pipeline.artifacts"}  # the package re-exports its modules; they never import it
    assert graph["sae_pipeline.artifacts.export"]  # the graph is read (export imports saelens, checkpoint, ...)
    assert find_cycles(graph) == []
    assert "sae_pipeline.artifacts.export" not in graph["sae_pipeline.artifacts.saelens"]


def test_the_cycle_check_finds_a_cycle() -> None:
    """The check itself, on export -> saelens -> export as it was before ``export_files``."""
    assert find_cycles({"export": {"saelens", "codes"}, "saelens": {"export"}, "codes": set()}) == [
        "export -> saelens -> export", "saelens -> export -> saelens"]
    assert find_cycles({"export": {"saelens"}, "saelens": {"export_files"}, "export_files": set()}) == []


def test_artifacts_import_only_the_layers_below() -> None:
    offending = [f"{fpath.name}: {name}" for fpath in sorted(ARTIFACTS_DPATH.glob("*.py"))
                 for name in sorted(imported_modules(fpath))
                 if name.startswith("sae_pipeline.") and not name.startswith(ALLOWED + PLUMBING)]
    assert offending == []
