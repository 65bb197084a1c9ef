"""Reading a file that a user or another program wrote: bounded JSON, and its text made safe for a terminal.

Why one module: every reader of such a file (a manifest, a sidecar, a sample's `meta.json`, a lock file,
an export's `config.json`, ...) must fail the same way on a damaged or forged one, as the one `error:`
line and exit 2 of docs/design.md ("Contracts"): never a `RecursionError`, `MemoryError` or
`UnicodeDecodeError` traceback, never the terminal's state changed by escape codes in the file.

- `load_json(path, what=..., fix=...)` / `parse_json(data, source=..., ...)`: the size is checked before
  anything is read (`max_bytes`), the bytes must be UTF-8, the JSON is parsed by the C decoder inside a
  `RecursionError` guard and its nesting then measured by an iterative walk (`max_depth`); NaN and
  Infinity (which no writer here emits: `json.dumps(allow_nan=False)`), numbers too large for a float
  and integers of more than 400 digits are refused, and `kind=dict` / `kind=list` checks the top
  level. Every refusal is one exception (by default `ValueError`, which `exit_status.run_cli` turns
  into exit 2; pass `error=ShardFormatError` or another `ValueError` subclass) whose message is
  `PATH: WHAT PROBLEM; FIX`. The fields a reader relies on are still its own to check.
- `check_fields(doc, {"count": COUNT, "name": TEXT, ...})`: the fields a reader uses, each present and of
  its kind (`INT`, `COUNT` an integer >= 0, `NUMBER` finite, `TEXT`, `BOOL`, `OBJECT`, `LIST`,
  `list_of(kind)`, `nullable(kind)`, or any `Kind(test, "description")`), refused in the same one line.
- `terminal_text(text)`: control characters (C0, DEL, C1, and other non-printable ones: bidi
  overrides, zero-width marks) shown as `\\x1b`, `\\u202e`, ..., and long text cut, so text taken from
  a file can be printed. `shown(value)` is the same for `repr` of a value read from a file.
  `exit_status.one_line` applies `terminal_text` to every error line as a last line of defence.

Imports nothing of the project, so both packages (and `exit_status`) may use it.
"""

from __future__ import annotations

import json
import math
import numbers
import reprlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "BOOL",
    "COUNT",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DEPTH",
    "INT",
    "LIST",
    "NUMBER",
    "OBJECT",
    "TEXT",
    "Kind",
    "check_fields",
    "depth_of",
    "list_of",
    "load_json",
    "nullable",
    "parse_json",
    "shown",
    "terminal_text",
]

DEFAULT_MAX_BYTES = 64 << 20  # the largest manifest (100 000 shards, a long skipped list) is a few MiB
DEFAULT_MAX_DEPTH = 32  # no file of the formats nests deeper than 5; a forged one may nest 100 000 deep
_TEXT_LIMIT = 300
_MAX_INT_DIGITS = 400  # Python's own limit is 4300; no field of the formats needs more than 20


def terminal_text(text: object, limit: int | None = _TEXT_LIMIT) -> str:
    """`text` (made a `str`) with every non-printable character escaped, cut to `limit` characters.

    Printable non-ASCII letters stay as they are; newlines and tabs are escaped too, so the result
    is one line. A cut is marked `...(N more characters)`.
    """
    text = text if isinstance(text, str) else str(text)
    cut = ""
    if limit is not None and len(text) > limit:
        text, cut = text[:limit], f"...({len(text) - limit} more characters)"
    if text.isprintable():
        return text + cut
    return "".join(c if c.isprintable() else _escape(c) for c in text) + cut


def _escape(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxdict = 6
_REPR.maxlevel = 3


def shown(value: object) -> str:
    """A short, escaped `repr` of a value read from a file, for an error line (bounded in length and depth)."""
    return terminal_text(_REPR.repr(value))


def depth_of(value: object) -> int:
    """How deeply lists and dicts nest in `value` (a scalar is 0, `[]` is 1); iterative, so any depth is measured."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node if isinstance(child, (list, dict)))
    return deepest


def _refuse_constant(name: str) -> float:
    raise ValueError(f"holds {name}, which is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"holds the number {text[:40]}{'...' if len(text) > 40 else ''}, too large for a float")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"holds an integer of {len(text.lstrip('-'))} digits, more than any field takes")
    return int(text)


def parse_json(
    data: bytes | str,
    *,
    source: object,
    what: str,
    fix: str,
    max_depth: int = DEFAULT_MAX_DEPTH,
    kind: type | None = None,
    allow_nan: bool = False,
    error: type[ValueError] = ValueError,
) -> Any:  # noqa: ANN401 (any JSON value)
    """`data` (bytes already read, e.g. a tar member) parsed as JSON, refusing what `load_json` refuses.

    `source` names where the bytes came from (a path, `shard-000003.tar member x.meta.json`).
    """

    def refuse(problem: str) -> ValueError:
        return error(f"{source}: {what} {problem}; {fix}")

    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exn:
            raise refuse(f"is not valid JSON (not UTF-8 text: byte {exn.start})") from None
    try:
        if allow_nan:
            value = json.loads(data, parse_int=_bounded_int)
        else:
            value = json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except RecursionError:
        raise refuse(f"nests lists or objects more than {max_depth} deep") from None
    except json.JSONDecodeError as exn:
        raise refuse(f"is not valid JSON ({exn.msg}: line {exn.lineno} column {exn.colno})") from None
    except ValueError as exn:  # a refused constant, float or integer
        raise refuse(terminal_text(exn, 120)) from None
    if depth_of(value) > max_depth:
        raise refuse(f"nests lists or objects more than {max_depth} deep")
    if kind is not None and not isinstance(value, kind):
        expected = {dict: "a JSON object", list: "a JSON list"}.get(kind, kind.__name__)
        raise refuse(f"must be {expected}, not {type(value).__name__ if value is not None else 'null'}")
    return value


def load_json(
    path: Path,
    *,
    what: str,
    fix: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    kind: type | None = None,
    allow_nan: bool = False,
    error: type[ValueError] = ValueError,
) -> Any:  # noqa: ANN401 (any JSON value)
    """The JSON file at `path` (a `Path`, or a `RemotePath` in a store), checked as the module docstring says.

    `what` names the file's role (`"manifest"`, `"sidecar"`), `fix` what the user should do
    (`"re-run finalize"`); a refusal raises `error(f"{path}: {what} PROBLEM; {fix}")`. A file larger
    than `max_bytes` is refused before it is read. A missing or unreadable file is the `OSError` it is.
    """
    size = path.stat().st_size
    if size > max_bytes:
        raise error(f"{path}: {what} is {size} bytes, more than the {max_bytes} it can take; {fix}")
    if isinstance(path, Path):  # no more than the limit, whatever the file (a FIFO, /dev/zero) turns out to hold
        with path.open("rb") as f:
            data = f.read(size + 1)  # a read's buffer is allocated whole: sized by the file, not by the limit
            while len(data) <= max_bytes and (more := f.read(min(1 << 20, max_bytes + 1 - len(data)))):
                data += more
    else:
        data = path.read_bytes()
    if len(data) > max_bytes:  # grew between the stat and the read
        raise error(f"{path}: {what} is over {max_bytes} bytes; {fix}")
    return parse_json(
        data, source=path, what=what, fix=fix, max_depth=max_depth, kind=kind, allow_nan=allow_nan, error=error
    )


class Kind(NamedTuple):
    """What a field must be: `test(value)` True, described as `text` in the refusal (`"an integer >= 0"`)."""

    test: Callable[[Any], bool]
    text: str


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


INT = Kind(_is_int, "an integer")
COUNT = Kind(lambda v: _is_int(v) and v >= 0, "an integer >= 0")
NUMBER = Kind(lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v), "a finite number")
TEXT = Kind(lambda v: isinstance(v, str), "a string")
BOOL = Kind(lambda v: isinstance(v, bool), "true or false")
OBJECT = Kind(lambda v: isinstance(v, dict), "a JSON object")
LIST = Kind(lambda v: isinstance(v, list), "a JSON list")


def list_of(kind: Kind) -> Kind:
    return Kind(lambda v: isinstance(v, list) and all(kind.test(x) for x in v), f"a list of {kind.text}s")


def nullable(kind: Kind) -> Kind:
    return Kind(lambda v: v is None or kind.test(v), f"null or {kind.text}")


def check_fields(
    doc: Mapping[str, Any],
    fields: Mapping[str, Kind],
    *,
    source: object,
    what: str,
    fix: str,
    optional: tuple[str, ...] = (),
    error: type[ValueError] = ValueError,
) -> Mapping[str, Any]:
    """`doc` when each of `fields` is present (those in `optional` may be absent) and of its kind.

    Otherwise `error("SOURCE: WHAT lacks field 'x'; FIX")` or `error("SOURCE: WHAT field 'x' must be
    KIND, got VALUE; FIX")`, the value shown short and escaped (`shown`).
    """
    for name, kind in fields.items():
        if name not in doc:
            if name in optional:
                continue
            raise error(f"{source}: {what} lacks field {name!r}; {fix}")
        if not kind.test(doc[name]):
            raise error(f"{source}: {what} field {name!r} must be {kind.text}, got {shown(doc[name])}; {fix}")
    return doc
