"""Training: what a ``fit`` / ``validate`` / ``test`` / ``predict`` run adds to an SAE (Lightning).

- :mod:`.module`: :class:`~sae_pipeline.training.module.SAEModule`, the LightningModule around an
  injected SAE (optimiser and schedule, unit-norm atoms, input normalisation, exact metrics).
- :mod:`.group`: :class:`~sae_pipeline.training.group.SAEGroupModule`, many SAEs trained on one data
  stream in one run, each as it would train alone.
- :mod:`.callbacks`: the TensorBoard figures logged at validation.
- :mod:`.checkpointing`: where a run's checkpoints live, ``--ckpt_path last``, atomic writes (reads go
  through :mod:`sae_pipeline.artifacts.checkpoint`, the one reader every command uses).
- :mod:`.interrupts`, :mod:`.requeue`, :mod:`.step_boundary`: SIGTERM / Ctrl-C and SLURM's requeue
  signal, acted on at the same step boundaries on every rank.
- :mod:`.lightning_compat`: every use of Lightning's private internals, in one place.
- `.ddp`: DDP's gradient all-reduce at SAE step times (bucket views, `--ddp.grad_compression`).
- :mod:`.predict`: the prediction writer of ``predict`` (the codes file, :mod:`sae_pipeline.artifacts.codes`).

This package sits above :mod:`sae_pipeline.sae`, :mod:`sae_pipeline.data`, :mod:`sae_pipeline.metrics`,
:mod:`sae_pipeline.figures` and :mod:`sae_pipeline.artifacts`, and below the commands, the evaluation
included (``tests/test_import_rules.py``).
"""
