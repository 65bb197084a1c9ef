"""The SAE's host-side hooks around a hand-written training loop, called where `SAEModule` calls them.

`SparseAutoencoder.begin_fit` once before a fit's first step (the module's ``on_train_start``),
`plan_step` before each step (``on_train_batch_start``) and `after_step` after it, its optimiser step and
unit-norm atoms included (``on_train_batch_end``). Every benchmark that writes the step out by hand
(benchmarks/train_step.py's bare loop, benchmarks/gpu.py, benchmarks/ddp.py, our contender in
benchmarks/peers.py, benchmarks/scaling/points.py) goes through :class:`FitHooks`, so that it times the step
training runs.

Why: where the step reads no device value (a GPU), TopK's AuxK follows a dead count that the host reads a few
steps late (`sae_pipeline.sae.late_count`), kept by these hooks; with no dead latent the plan queues no AuxK work
at all. A loop that skips them leaves the plan unset, and the step runs the masked AuxK over all ``d_sae``
latents on every step (`TopKSAE.auxiliary_loss`): not the step a fit runs. On the CPU the hooks change nothing
(the step reads the dead count itself there).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager

from sae_pipeline.sae import SparseAutoencoder


class FitHooks:
    """One fit of ``sae`` by a hand-written loop: ``begin_fit`` now, then ``with hooks.step(): ...`` around each
    step (forward, loss, backward, optimiser, unit-norm atoms).

    Build it once the SAE is on its device and its dead-latent clock is what the fit starts from (the late dead
    count starts from the clock read here, as the module's ``on_train_start`` reads the restored one). ``steps``
    counts the steps planned so far; a step that raises is not followed by ``after_step``.
    """

    def __init__(self, sae: SparseAutoencoder) -> None:
        self.sae = sae
        self.steps = 0
        self.key: Hashable = None  # the plan of the step under way (`SparseAutoencoder.plan_step`)
        sae.begin_fit()

    @contextmanager
    def step(self) -> Iterator[Hashable]:
        """``plan_step`` before the body (its key is what the ``with`` gives), ``after_step`` after it."""
        self.key = self.sae.plan_step()
        yield self.key
        self.sae.after_step()
        self.steps += 1
