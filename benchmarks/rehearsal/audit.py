"""The rehearsal's batch audit: which tokens each optimizer step of ``fit`` trained on, across a ``kill -9``.

``fit`` resumes mid-epoch by replaying the interrupted epoch's seeded stream and skipping the
batches its checkpoint had already trained on (``sae_pipeline.data.loaders.TrainTokenLoader``).
The rehearsal checks that claim on its own shards rather than trusting it: :class:`BatchAudit`, a
callback the rehearsal's config adds to ``fit``, appends one record per training batch (the global
step before it and a 64-bit hash of each of its tokens) to the file named by ``$SAE_REHEARSAL_AUDIT``,
unbuffered, so a SIGKILL loses at most the record being written. With ``$SAE_REHEARSAL_HOLD_AT``
(``STEP:FILE``) it holds the run before step STEP and creates FILE, so the kill lands at a known
step. :func:`check_resume` then stitches the killed run's batches before its checkpoint to the
resumed run's and compares them, token by token, with the hashes recorded while generating the
tokens.

A token's hash is ``shards.token_hashes`` (beside this): the callback (on the batch Lightning hands the
step) and the generator (on the array it writes) agree bit for bit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.rehearsal.shards import token_hashes

AUDIT_ENV = "SAE_REHEARSAL_AUDIT"
HOLD_ENV = "SAE_REHEARSAL_HOLD_AT"


class BatchAudit(Callback):
    """Append ``[global_step, n_tokens, hash_0 .. hash_{n-1}]`` (int64/uint64) per training batch to
    ``$SAE_REHEARSAL_AUDIT`` (nothing when it is unset)."""

    def __init__(self) -> None:
        self.fpath = os.environ.get(AUDIT_ENV)
        self._fd: int | None = None
        hold = os.environ.get(HOLD_ENV)  # "STEP:FILE": stop before training step STEP and create FILE
        self.hold_at, self.hold_fpath = (int(hold.split(":", 1)[0]), hold.split(":", 1)[1]) if hold else (None, None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if not self.fpath:
            return
        if self._fd is None:
            self._fd = os.open(self.fpath, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        x = batch["x"].detach().cpu().to(dtype=torch.float16).numpy()  # exact: the shards are float16
        record = np.concatenate([np.array([trainer.global_step, len(x)], np.int64).view(np.uint64), token_hashes(x)])
        os.write(self._fd, record.tobytes())
        if trainer.global_step == self.hold_at:  # the rehearsal kills the process (SIGKILL) once the file exists
            Path(self.hold_fpath).touch()
            while True:
                time.sleep(1)

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_audit(fpath: Path) -> list[tuple[int, np.ndarray]]:
    """The ``(global_step, hashes)`` records of an audit file; a record cut by a kill is dropped."""
    words = np.frombuffer(Path(fpath).read_bytes()[: (Path(fpath).stat().st_size // 8) * 8], np.uint64)
    records, at = [], 0
    while at + 2 <= len(words):
        step, n = int(words[at]), int(words[at + 1])
        if at + 2 + n > len(words):
            break
        records.append((step, words[at + 2 : at + 2 + n].copy()))
        at += 2 + n
    return records


def check_resume(
    killed: Path, resumed: Path, ckpt_step: int, n_batches: int, batch_size: int, train_hashes: np.ndarray
) -> dict:
    """Check the stitched epoch (the killed run's steps < ``ckpt_step`` + the resumed run's) against the
    training split's token hashes; returns the counts and a list of ``failures`` (empty: none)."""
    first, second = read_audit(killed), read_audit(resumed)
    failures = []
    steps1, steps2 = [s for s, _ in first], [s for s, _ in second]
    if steps1 != list(range(len(steps1))):
        failures.append(f"killed run: steps not 0..{len(steps1) - 1} in order")
    if steps2 != list(range(ckpt_step, ckpt_step + len(steps2))):
        failures.append(f"resumed run: steps do not start at the checkpoint's {ckpt_step} and run on in order")
    if ckpt_step + len(steps2) != n_batches:
        failures.append(f"epoch: {ckpt_step} + {len(steps2)} resumed batches != {n_batches} batches per epoch")
    redone = [s for s in steps1 if s >= ckpt_step]  # trained by the killed run after its checkpoint: lost to the kill
    replay_equal = all(
        np.array_equal(first[s][1], second[s - ckpt_step][1]) for s in redone if s - ckpt_step < len(second)
    )
    if not replay_equal:
        failures.append("the resumed run's batches after the checkpoint differ from the killed run's")
    stitched = [h for s, h in first if s < ckpt_step] + [h for _, h in second]
    sizes = {len(h) for h in stitched}
    if sizes != {batch_size}:
        failures.append(f"batch sizes {sorted(sizes)} != {{{batch_size}}}")
    seen = np.concatenate(stitched) if stitched else np.zeros(0, np.uint64)
    unique_seen, counts = np.unique(seen, return_counts=True)
    repeated = int((counts - 1).sum())
    unique_train = np.unique(train_hashes)
    foreign = int(len(unique_seen) - np.isin(unique_seen, unique_train, assume_unique=True).sum())
    lost = int(len(unique_train) - np.isin(unique_train, unique_seen, assume_unique=True).sum())
    if len(unique_train) != len(train_hashes):
        failures.append("the training split has tokens with equal hashes: the audit cannot tell them apart")
    if repeated:
        failures.append(f"{repeated} tokens trained on twice in the epoch")
    if foreign:
        failures.append(f"{foreign} tokens trained on are not in the training split")
    if not 0 <= lost < batch_size:
        failures.append(f"{lost} training tokens never trained on in the epoch (the stream drops < one batch)")
    return {
        "checkpoint_step": ckpt_step,
        "killed_run_batches": len(first),
        "redone_after_kill": len(redone),
        "resumed_run_batches": len(second),
        "epoch_batches": len(stitched),
        "expected_batches": n_batches,
        "tokens_trained": int(len(seen)),
        "train_tokens": int(len(train_hashes)),
        "tokens_left_out": lost,
        "tokens_repeated": repeated,
        "tokens_foreign": foreign,
        "replay_equal": bool(replay_equal),
        "failures": failures,
    }
