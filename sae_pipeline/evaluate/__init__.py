"""The evaluation suite: the paper's controlled experiment over the SAE variants, in one command.

``python -m sae_pipeline.evaluate {expressivity,inference,coherence,concepts,probing,all,report,dictionary,sae}``
(see :mod:`sae_pipeline.evaluate.__main__`). One concept per module:

- `.parser`: the flags of every subcommand; `.study_runner`: what a study subcommand does, start to end;
- :mod:`.runs`: plan the grid of training runs; :mod:`.run_training`: train / export / resume them through the CLI;
- `.data_flags`: how evaluate spells its data flags in advice (``--data_dpath``, not fit's), MNIST checked early;
- :mod:`.studies`: evaluate each exported run and gather the numbers per study (each SAE's numbers and curves:
  :func:`sae_pipeline.metrics.evaluate_sae`, which the training callback logs too);
- :mod:`.concepts`: per-atom statistics, selection order, sequential reconstruction;
- :mod:`.probing`: SAEBench's sparse probing on labelled images, and each run's R² on its training rows;
- :mod:`.claims`: the paper's claims checked against the numbers;
- `.report`: results.json and report.md; `.report_figures`: the PNGs and their TensorBoard copies (drawn by
  `sae_pipeline.figures`);
- :mod:`.external`: load a released MP-SAE dictionary (``.npz``) and evaluate it.
"""
