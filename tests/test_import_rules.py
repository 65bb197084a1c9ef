"""Which module may import which: training and the SAEs do not depend on the commands.

``sae_pipeline.training.module`` (training) reads and writes an SAE through ``sae_pipeline.sae`` only, never
through the export or predict commands, so a change to a command cannot break training; the
``sae`` package is the bottom layer and imports none of the modules built on it. Checked on the
source (every import statement, also inside functions) and on a real import (what it pulls in).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DPATH = Path(__file__).resolve().parents[1] / "sae_pipeline"
COMMANDS = ("sae_pipeline.artifacts.export", "sae_pipeline.training.predict")
ABOVE_SAE = (*COMMANDS, "sae_pipeline.training.module", "sae_pipeline.cli", "sae_pipeline.training.callbacks", "sae_pipeline.evaluate")


def imported_modules(fpath: Path, root: Path = PACKAGE_DPATH.parent) -> set[str]:
    """Every module an ``import`` / ``from ... import`` statement in ``fpath`` names (absolute; relative
    imports resolved against ``fpath``'s package under ``root``)."""
    package = ".".join(fpath.relative_to(root).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(fpath.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from sae_pipeline.artifacts import export`
    return names


def offending(names: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(name for name in names if any(name == f or name.startswith(f + ".") for f in forbidden))


def test_imported_modules_sees_nested_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: it must catch the ways an import can be written (so the rules can fail)."""
    probe = tmp_path / "sae_pipeline" / "sae" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("import os\nfrom sae_pipeline.artifacts import export\ndef f():\n    from ..training.predict import sparse_codes\n"
                     "    import sae_pipeline.training.module as m\n")
    assert offending(imported_modules(probe, tmp_path), ABOVE_SAE) == [
        "sae_pipeline.artifacts.export", "sae_pipeline.training.module", "sae_pipeline.training.predict", "sae_pipeline.training.predict.sparse_codes"]


def test_training_module_imports_no_command() -> None:
    assert offending(imported_modules(PACKAGE_DPATH / "training" / "module.py"), COMMANDS) == []


@pytest.mark.parametrize("fpath", sorted((PACKAGE_DPATH / "sae").glob("*.py")), ids=lambda p: p.name)
def test_sae_package_imports_nothing_built_on_it(fpath: Path) -> None:
    assert offending(imported_modules(fpath), ABOVE_SAE) == []


def test_importing_the_training_module_loads_no_command() -> None:
    """Transitively too: a fresh interpreter that imports ``sae_pipeline.training.module`` has not loaded a command."""
    code = ("import sys, sae_pipeline.training.module\n"
            f"print(' '.join(m for m in sys.modules if m.startswith({COMMANDS!r})))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []
