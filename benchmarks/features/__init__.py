"""The feature browser's cost: its pass against a bare `predict`, memory, site (`python -m benchmarks.features`).

`__main__.py` the command and the pass parts, `site.py` the site parts, `sparse.py` the sparse-codes
part, `data.py` the synthetic shards and SAE they all use (the scaling benchmark's feature parts too).
Nothing is imported here, so the helpers load without the driver.
"""
