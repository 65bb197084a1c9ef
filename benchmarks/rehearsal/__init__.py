"""Rehearsal at 1/50 of ImageNet: every stage end to end, with a `kill -9` (`python -m benchmarks.rehearsal`).

`__main__.py` the command and its stages, `shards.py` the synthetic DINOv2-shaped shards (stage 1, also
read by `benchmarks/data_cache.py`), `audit.py` the callback that checks the resumed epoch. Nothing is
imported here: the audit callback loads inside `fit` without the driver.
"""
