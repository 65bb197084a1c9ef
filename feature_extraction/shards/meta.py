"""A sample's `meta.json`: the one reader, for the training stream's reader and webdataset's decoding alike.

The extraction writes it (`shard_loop._record_meta`): the image's original `image_id`, its class
`label` (null without classes) and `class_name`, where the image came from (`source`, and `member`
of a tar) and the content hash the feature browser checks (`image_xxh3_64`). It is not covered by
the sidecar's checksums, and the feature browser, the probes and the causal evaluation use its
fields, so it is parsed with bounds (`file_checks`: at most `MAX_META_BYTES`, nesting, UTF-8) and
each of these fields, when present, must be of its kind: a forged one is one `ShardFormatError` line
naming the shard and the member, never a traceback further on. Other fields (a hand-made shard's)
are kept as they are.
"""

from __future__ import annotations

from feature_extraction.file_checks import INT, TEXT, check_fields, nullable, parse_json
from feature_extraction.shards.layout import ShardFormatError

__all__ = ["MAX_META_BYTES", "META_KINDS", "parse_meta"]

MAX_META_BYTES = 1 << 20  # a meta.json holds an id, a label and a source: a few hundred bytes
META_KINDS = {
    "image_id": TEXT,
    "label": nullable(INT),
    "class_name": TEXT,
    "source": TEXT,
    "member": TEXT,
    "image_xxh3_64": TEXT,
}


def parse_meta(data: bytes, source: object, what: str) -> dict:
    """One sample's `meta.json` bytes as a dict, checked (module docstring); `source` names the shard, `what` the
    member (`member 'KEY.meta.json'`), as the refusal names them."""
    fix = "re-extract the shard"
    if len(data) > MAX_META_BYTES:
        raise ShardFormatError(f"{source}: {what} is {len(data)} bytes, more than a meta.json takes; {fix}")
    check = dict(source=source, what=what, fix=fix, error=ShardFormatError)
    meta = parse_json(data, kind=dict, **check)
    return dict(check_fields(meta, META_KINDS, optional=tuple(META_KINDS), **check))
