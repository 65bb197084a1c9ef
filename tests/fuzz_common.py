"""What the two fuzz files share (tests/test_fuzz_shard_files.py, tests/test_fuzz_pipeline_files.py): Hypothesis's
settings for a fixed, reproducible example count, the control characters no terminal line may carry, and the marker
of a field written as raw text."""

from __future__ import annotations

import copy
import re
from typing import Any

from hypothesis import HealthCheck, settings

#: C0 and C1 controls (tab and newline aside), zero-width and bidirectional marks: what `terminal_text` escapes
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e]")


class Raw(str):
    """A field to be replaced by raw text after serialising (each fuzz file's `RAW`)."""


def fuzzed(examples: int) -> Any:  # noqa: ANN401 (a decorator)
    """``examples`` derandomized examples, no deadline, no example database: CI runs the same examples each time."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


DELETE = object()  # `mutated`'s value for "remove the field"


def mutated(doc: Any, path: tuple, value: Any) -> Any:  # noqa: ANN401 (JSON)
    """A copy of ``doc`` with the field at ``path`` replaced by ``value`` (deleted when ``value`` is `DELETE`)."""
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc
