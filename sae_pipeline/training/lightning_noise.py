"""Silence the lines Lightning prints before every run that tell the user nothing about their run.

Before the first step of ``fit`` or the ``features`` pass Lightning prints about five lines of its
own: a hint to use ``srun`` (on any machine where ``srun`` exists, also when the run is meant to
be local), advertisements for its cloud products ("Tip: ... litlogger", "... litmodels"), "TPU
available: False", "Loading `train_dataloader` to estimate number of stepping batches", and a
deprecation warning from inside Lightning itself (``LeafSpec``, which the user cannot act on).
A group's fit with periodic checkpoints adds 13 lines of advice for manual optimisation that read
like a bug and do not apply (the group checkpoints the weights after the step on purpose).
They bury the product's own lines (``--ckpt_path last: FILE``, ``Final checkpoint ...``), so
:func:`quiet_lightning` drops exactly these, matched by their text: every other Lightning
message and warning (which GPU is used, a real misconfiguration) still shows.
"""

from __future__ import annotations

import logging
import re
import warnings

# rank_zero_info lines (logging) that are never about the user's run
NOISE_LINES = (
    r"💡 Tip: ",
    r"TPU available: ",
    r"HPU available: ",
    r"Loading `train_dataloader` to estimate number of stepping batches",
)
# warnings Lightning raises about itself or about a setting the product chose on purpose
NOISE_WARNINGS = (
    r"The `srun` command is available on your system but is not used",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Couldn't infer the batch indices fetched from your dataloader",  # predict: the codes carry their ids
    r"The dirpath has changed from",  # validate/test/predict from a checkpoint of another run folder
    # a group (manual optimisation) with --checkpoint.every_n_train_steps: 13 lines of advice to save the weights
    # from before the step; the checkpoint holds the weights after global_step steps on purpose (what a resume
    # continues from, as a single run's does)
    r"Using ModelCheckpoint with manual optimization and every_n_train_steps",
)
LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning")


class _DropNoise(logging.Filter):
    pattern = re.compile("|".join(NOISE_LINES))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


_FILTER = _DropNoise()


def quiet_lightning() -> None:
    """Drop :data:`NOISE_LINES` and :data:`NOISE_WARNINGS` for the rest of the process (idempotent)."""
    import lightning.pytorch  # noqa: F401 -- adds the handlers filtered below

    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
    for message in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{message}")
