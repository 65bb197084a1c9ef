"""What ``results.json`` must hold for the report and the figures to read it: checked before they do.

Why: ``results.json`` is the study's one source of numbers and may be edited, cut short or written by
another version; ``evaluate report`` rebuilds ``report.md`` from it alone and a study keeps (and draws)
the sections of earlier studies. Without a check a wrong-typed entry ends in a ``TypeError`` deep in
the report's formatting. With it, a file that is not what the readers expect is one line naming the
file, the field (``coherence.dictionary.topk[2]``), what it must be and the fix, exit 2.

The schema below is written from the readers (`report.py`, `report_figures.py`, `claims.py`): every
field they index is listed with its kind; a section they do not read (``claims``, ``saes``) is only
required to be what the writers append to. Constraints between fields that a schema of kinds cannot
state (a sweep's ``r2`` as long as its ``ks``, the variants of ``coactive`` those of ``dictionary``)
are rules on their section. What is still left (an index a section's numbers imply) is caught where
the report and figures are made (:func:`section_guard`), as the same one line naming the section.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from feature_extraction.file_checks import shown, terminal_text

__all__ = ["RESULTS_FNAME", "check_results", "section_guard", "shape_problem"]

RESULTS_FNAME = "results.json"
FIX = "rerun the study that wrote that section into this --out (it replaces the section), or delete the file"


class Kind:
    """A leaf of the schema: a JSON kind with its name for the error line."""

    def __init__(self, name: str, test: Callable[[Any], bool]) -> None:
        self.name, self.test = name, test


NUM = Kind("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
INT = Kind("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
POS = Kind("an integer >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)
STR = Kind("a string", lambda v: isinstance(v, str))
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
ANY = Kind("any value", lambda v: True)


class Nullable:
    def __init__(self, spec: Any) -> None:
        self.spec = spec


class Items:
    """A list of ``spec``, at least ``min_len`` long."""

    def __init__(self, spec: Any, min_len: int = 0) -> None:
        self.spec, self.min_len = spec, min_len


class Rule:
    """``spec``, then ``check(value)``: None, or what is wrong (for constraints between fields)."""

    def __init__(self, spec: Any, check: Callable[[Any], str | None]) -> None:
        self.spec, self.check = spec, check


def shape_problem(value: Any, spec: Any, path: str) -> str | None:
    """Where ``value`` departs from ``spec`` and how (``path must be ..., not ...``), or None.

    ``spec``: a :class:`Kind`; :class:`Nullable`, :class:`Items`, :class:`Rule`; a dict of keys (``"name?"``
    optional, ``"*"`` every key of a mapping, whatever its name). Recursion follows the schema, not the value,
    so its depth is the schema's.
    """
    if isinstance(spec, Nullable):
        return None if value is None else shape_problem(value, spec.spec, path)
    if isinstance(spec, Rule):
        return shape_problem(value, spec.spec, path) or _rule(spec, value, path)
    if isinstance(spec, Kind):
        return None if spec.test(value) else f"{path or 'the file'} must be {spec.name}, not {shown(value)}"
    if isinstance(spec, Items):
        if not isinstance(value, list) or len(value) < spec.min_len:
            least = f" of at least {spec.min_len} values" if spec.min_len else ""
            return f"{path} must be a list{least}, not {shown(value)}"
        return next((p for i, v in enumerate(value) if (p := shape_problem(v, spec.spec, f"{path}[{i}]"))), None)
    if not isinstance(value, dict):
        return f"{path or 'the file'} must be a JSON object, not {shown(value)}"
    for key, sub in spec.items():
        if key == "*":
            for name, item in value.items():
                if problem := shape_problem(item, sub, _join(path, name)):
                    return problem
            continue
        name, optional = key.rstrip("?"), key.endswith("?")
        if name not in value:
            if optional:
                continue
            return f"{_join(path, name)} is missing"
        if problem := shape_problem(value[name], sub, _join(path, name)):
            return problem
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{shown(key)[1:-1]}" if path else shown(key)[1:-1]


def _rule(spec: Rule, value: Any, path: str) -> str | None:
    problem = spec.check(value)
    return None if problem is None else f"{path}: {problem}"


def _sweep_lengths(sweep: dict) -> str | None:
    return None if len(sweep["r2"]) == len(sweep["ks"]) else "r2 must hold one value per entry of ks"


def _same_variants(*names: str) -> Callable[[dict], str | None]:
    def check(section: dict) -> str | None:
        first = section[names[0]]
        for name in names[1:]:
            other = section.get(name)
            if isinstance(other, dict) and other and set(first) - set(other):
                return f"{name} must hold every variant of {names[0]} ({', '.join(map(shown, sorted(first)))})"
        return None

    return check


def _babel_lengths(section: dict) -> str | None:
    for variant, curve in section["dictionary"].items():
        if len(section["coactive"].get(variant, curve)) < min(section["k"], len(curve)):
            return f"coactive.{shown(variant)} must be as long as the dictionary's curve up to k"
    return None


def _reaches_k(section: dict) -> str | None:
    for name in ("babel_dict", "babel_coactive"):
        if name in section and len(section[name]) < section["k"]:
            return f"{name} must hold at least k = {section['k']} values"
    return None


def _with_data(section: dict) -> str | None:
    if not section.get("data"):
        return None
    missing = [name for name in DICTIONARY_DATA if name not in section]
    return f"with data it must also hold {', '.join(missing)}" if missing else None


SWEEP = Rule({"ks": Items(INT), "r2": Items(NUM)}, _sweep_lengths)
NUMS = Items(NUM, 1)
SUPPORT = {
    "restricted_babel": Items(Nullable(NUM)),
    "restricted_tokens": Items(NUM),
    "n_tokens": NUM,
    "mean_support": NUM,
    "mean_pairwise": Nullable(NUM),
}
RUN = {
    "r2": NUM,
    "l0": NUM,
    "k?": INT,
    "p?": INT,
    "inference?": SWEEP,
    "babel_dict?": NUMS,
    "babel_coactive?": NUMS,
    "support_coherence?": Nullable(SUPPORT),
}
ROW = {"r2": NUM, "l0": NUM, "k": INT, "p": INT}
SEQUENCE = {
    "input": Items(NUM),
    "order": Items(INT),
    "coefficients": Items(NUM),
    "shown_steps": Items(INT),
    "partials": Items(Items(NUM)),
}
CONCEPT_STATS = {
    "n_fired": INT,
    "frequency_cv": NUM,
    "mean_value_cv": NUM,
    "value_when_active_cv?": Nullable(NUM),
    "spearman_mean_vs_step": Nullable(NUM),
    "spearman_frequency_vs_mean": Nullable(NUM),
    "spearman_value_when_active_vs_step?": Nullable(NUM),
    "spearman_frequency_vs_value_when_active?": Nullable(NUM),
    "frequency?": Items(Nullable(NUM)),
    "mean_value?": Items(Nullable(NUM)),
    "mean_step?": Items(Nullable(NUM)),
    "value_when_active?": Items(Nullable(NUM)),
    "top_by_frequency?": Items(INT),
    "top_by_mean?": Items(INT),
    "sequence?": SEQUENCE,
    "run?": Rule(STR, lambda v: None if v and Path(v).name == v and v not in (".", "..") else "must name a folder"),
}
ACCURACY = {"mean": {"*": NUM}, "interval?": Nullable({"*": Nullable(Items(NUM, 2))}), "n_columns?": Nullable(INT)}
PROBED = {**ACCURACY, "k?": INT, "p?": INT, "r2_train?": NUM, "r2_val?": NUM}
COMPARISON = {
    "a": STR,
    "b": STR,
    "key": STR,
    "difference": NUM,
    "significant": BOOL,
    "classes_higher": INT,
    "n_classes": INT,
}
DICTIONARY_DATA = ("concepts", "inference", "n_tokens", "r2", "babel_coactive")

#: Every section a reader indexes; a section not named here is kept as it is and never read.
SCHEMA = {
    "meta?": {
        "data?": ANY,
        "variants?": Items(STR),
        "studies?": Items(STR),
        "wall_time_s?": NUM,
        "command?": STR,
    },
    "runs?": {"*": RUN},
    "saes?": {"*": ANY},
    "expressivity?": {
        "vs_k": Rule({"*": Items(ROW, 1)}, lambda v: None if v else "must name at least one variant"),
        "vs_p": Rule({"*": Items(ROW, 1)}, lambda v: None if v else "must name at least one variant"),
        "p_main": INT,
        "k_main": INT,
    },
    "inference?": {"main": {"*": SWEEP}, "by_train_k": {"*": {"*": SWEEP}}, "k_train": INT, "p": INT},
    "coherence?": Rule(
        Rule(
            {
                "k": POS,
                "p": INT,
                "dictionary": {"*": NUMS},
                "coactive": {"*": NUMS},
                "support?": Nullable({"*": SUPPORT}),
            },
            _same_variants("dictionary", "coactive", "support"),
        ),
        _babel_lengths,
    ),
    "concepts?": {
        "k?": INT,
        "p?": INT,
        "image_shape?": Nullable(Items(POS)),
        "variants": {"*": {**CONCEPT_STATS, "negative_atom": {"cosine_with_minus_b_pre": NUM, "frequency_rank": INT}}},
    },
    "reference?": Rule(
        {
            "npz": ANY,
            "p": ANY,
            "k": POS,
            "n_eval_tokens": ANY,
            "same_rows_as": STR,
            "r2": NUM,
            "inference": SWEEP,
            "babel_dict": NUMS,
            "babel_coactive": NUMS,
            "support_coherence?": Nullable(SUPPORT),
            "concepts?": Nullable({"top_by_frequency": Items(INT), "top_by_mean": Items(INT)}),
        },
        _reaches_k,
    ),
    "dictionary?": Rule(
        Rule(
            {
                "p": ANY,
                "d_in": ANY,
                "k": POS,
                "babel_dict": NUMS,
                "babel_coactive?": NUMS,
                "data?": ANY,
                "n_tokens?": ANY,
                "r2?": Nullable(NUM),
                "inference?": SWEEP,
                "concepts?": CONCEPT_STATS,
            },
            _reaches_k,
        ),
        _with_data,
    ),
    "probing?": {
        "ks": Items(INT),
        "labels": Items(ANY, 1),
        "n_train_rows": ANY,
        "n_val_rows": ANY,
        "seeds?": POS,
        "task_rows": {"train": {"*": NUM}, "val": {"*": NUM}},
        "raw": ACCURACY,
        "variants": {"*": PROBED},
        "reference?": PROBED,
        "comparisons?": Nullable(Items(COMPARISON)),
    },
}


def check_results(results: Any, fpath: Path | str) -> dict[str, Any]:
    """``results`` (parsed from ``fpath``) if it holds what the readers read; else one ValueError naming the field."""
    problem = shape_problem(results, SCHEMA, "")
    if problem:
        raise ValueError(f"{fpath}: {problem}; {FIX}")
    return results


@contextlib.contextmanager
def section_guard(fpath: Path | str, section: str) -> Iterator[None]:
    """What the schema cannot state (an index one field of a section implies into another) found while the
    report or a figure reads ``section``: one ValueError naming the file and the section, the cause chained
    (``SAE_PIPELINE_TRACEBACK=1`` shows it)."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError, ZeroDivisionError, StopIteration, ValueError) as exn:
        if isinstance(exn, ValueError) and type(exn) is not ValueError:
            raise  # a ValueError of ours (an export that does not load) names its own file
        raise ValueError(
            f"{fpath}: its {section!r} section does not hold what the report reads ({type(exn).__name__}: "
            f"{terminal_text(exn, 120)}); {FIX}"
        ) from exn
