"""The Markdown pieces every section of ``report.md`` is written with (evaluate/report.py, probing_report.py,
seed_report.py): one table form and one number form, so that the sections read alike."""

from __future__ import annotations


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def fmt(value: float | None, spec: str = "+.2f") -> str:
    """``n/a`` for a value a study did not measure."""
    return "n/a" if value is None else format(value, spec)
