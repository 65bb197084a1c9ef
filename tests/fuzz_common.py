"""What the two fuzz files share (tests/test_fuzz_shard_files.py, tests/test_fuzz_pipeline_files.py): Hypothesis's
settings for a fixed, reproducible example count, the control characters no terminal line may carry, and the JSON
mutations (one field replaced or deleted, raw text spliced in, the file cut short or replaced whole); each file
gives its own replacement values (`WRONG`, `RAW`, `WHOLE`)."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

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


def paths(value: Any, prefix: tuple = (), limit: int = 3) -> list[tuple]:  # noqa: ANN401 (JSON)
    """Every place in a JSON document (a list's first ``limit`` items and its last), the root excluded."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
        items = items[:limit] + items[-1:] if len(items) > limit else items
    else:
        return []
    found = []
    for key, child in items:
        found += [(*prefix, key), *paths(child, (*prefix, key), limit)]
    return found


def json_bytes(doc: Any, raw: dict[str, str]) -> bytes:  # noqa: ANN401 (JSON)
    """``doc`` as a file, each `Raw` field (U+E000 then NAME) replaced by the text ``raw[NAME]``."""
    text = json.dumps(doc, ensure_ascii=False)
    for name, spliced in raw.items():
        text = text.replace(json.dumps(Raw(f"\ue000{name}"), ensure_ascii=False), spliced)
    return text.encode("utf-8", "surrogatepass")


def json_mutations(
    doc: Any,  # noqa: ANN401 (JSON)
    wrong: list[Any],
    raw: dict[str, str],
    whole: list[bytes],
    limit: int | None = None,
) -> st.SearchStrategy[bytes]:
    """The file as bytes: one field replaced (by a ``wrong`` value or ``raw`` text) or deleted, the text cut short,
    replaced by one of ``whole``, or padded past ``limit`` (the reader's size limit, when it is small enough to
    write for each example)."""
    places = paths(doc)
    text = json_bytes(doc, raw)
    values = st.sampled_from(wrong) | st.sampled_from([Raw(f"\ue000{name}") for name in raw])
    keyed = [p for p in places if isinstance(p[-1], str)] or places
    padded = [] if limit is None else [text + b" " * (limit + 1 - len(text))]
    return st.one_of(
        st.builds(lambda p, v: json_bytes(mutated(doc, p, v), raw), st.sampled_from(places), values),
        st.sampled_from(keyed).map(
            lambda p: json_bytes(mutated(doc, p, DELETE), raw) if isinstance(p[-1], str) else text
        ),
        st.integers(0, len(text) - 1).map(lambda n: text[:n]),
        st.sampled_from([*whole, *padded]),
    )
