"""`extraction.json` sealed: the sha256 of its content is stored in it, so a hand edit is found, not believed.

Why: every task and rerun compares its settings with the record and `finalize` builds the manifest
from it (the backbone record, the number of shards). An edited field would be believed: a rerun
with the edited layer would mix two layers' shards in one directory, and an edited `n_shards`
would list shards that do not exist. The digest is over the record as JSON reads it back (keys
sorted), so it does not depend on the file's spacing; a record written before the digest has
none and is read as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

__all__ = ["DIGEST_FIELD", "check_sealed", "seal"]

DIGEST_FIELD = "record_sha256"


def _digest(record: dict) -> str:
    content = {k: v for k, v in json.loads(json.dumps(record)).items() if k != DIGEST_FIELD}
    return hashlib.sha256(json.dumps(content, sort_keys=True, allow_nan=False).encode("utf-8")).hexdigest()


def seal(record: dict) -> dict:
    """``record`` with its digest added (what `extraction.json` holds)."""
    return {**record, DIGEST_FIELD: _digest(record)}


def check_sealed(stored: dict, fpath: Path, expected: dict | None = None) -> None:
    """ValueError (one line naming ``fpath`` and the fix) when ``stored`` no longer matches its digest.

    ``expected``: what this run would write, to name the fields the edit may have touched.
    """
    if DIGEST_FIELD not in stored or stored[DIGEST_FIELD] == _digest(stored):
        return
    differ = ""
    if expected is not None:
        expected = json.loads(json.dumps(expected))  # tuples read back as lists
        fields = sorted(k for k in {*stored, *expected} - {DIGEST_FIELD} if stored.get(k) != expected.get(k))
        differ = f"; fields that differ from this run's: {', '.join(fields)}" if fields else ""
    raise ValueError(
        f"{fpath} was edited after the extraction wrote it (its content no longer matches its {DIGEST_FIELD}"
        f"{differ}); undo the edit (the file must hold what the extraction wrote), or extract into another --out"
    )
