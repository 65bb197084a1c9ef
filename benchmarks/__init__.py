"""Benchmarks: each module measures one part of the pipeline against a plain reference, in the same run.

A package so that every benchmark runs the same way, from the repository root, with no path set up
by hand: ``python -m benchmarks.mp_sae`` (``--help`` for the options of each). A benchmark of many
modules is a subpackage run the same way, its command in ``__main__.py``: ``benchmarks/scaling/``
(``python -m benchmarks.scaling``), ``benchmarks/rehearsal/``, ``benchmarks/features/``. The tests import
helpers from here (``benchmarks/backbone_recipe.py``); nothing here imports from ``tests/``. Results
and the commands that gave them: BENCHMARKS.md.
"""
