"""On a GPU the captured training step (`sae_pipeline.training.graph_step`) trains as the eager step, for
every variant: float64, the warm-up/cosine learning rate changing between replays, a partial batch
falling back for its step; and a ``fit`` with the graph does not synchronise on the steps Lightning
does not log (CUDA's own check). The CPU counterpart, without capture, is ``tests/test_graph_step.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from sae_pipeline.sae import SAE_REGISTRY
from sae_pipeline.training.graph_step import WARMUP_STEPS
from tests.test_gpu_sync import CudaSyncCheck
from tests.test_graph_step import BATCH, assert_same_training, fit
from tests.test_module import make_data
from tests.test_sync_free import LOG_EVERY

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = WARMUP_STEPS + 6  # eager warm-up, the capture (replayed once), 5 more replays
SCHEDULE = {"warmup_steps": 3, "lr": 1e-2, "min_lr": 1e-4}
CUDA = {"accelerator": "cuda", "devices": 1}


def captured(module: Any, steps: int) -> None:
    """Every step of ``steps`` whose loss does not change with the step ran through the captured graph."""
    static = module.graph_step.static
    runs = steps - eager_steps(module, steps)
    assert static is not None and static.graph is not None and static.runs == runs


def eager_steps(module: Any, steps: int) -> int:
    """The steps that run eagerly before the `StaticStep` takes over (ReLU's L1 warm-up)."""
    return sum(module.sae.step_dependent(step) for step in range(steps))


@pytest.mark.parametrize("key", sorted(SAE_REGISTRY))
def test_graph_trains_as_the_eager_step(tmp_path: Path, key: str) -> None:
    """Float64 (the learning rate a float32 tensor in the graph's Adam: ~1e-8 apart per step)."""
    data = make_data(STEPS * BATCH).double()
    runs: dict[str, Any] = {"run_settings": {**CUDA, "precision": "64-true"}, "sync_free": None, **SCHEDULE}
    eager = fit(tmp_path / "eager", key, False, data, STEPS, **runs)
    graph = fit(tmp_path / "graph", key, True, data, STEPS, **runs)
    captured(graph[0], STEPS)
    assert_same_training(eager, graph, key, rtol=1e-5)


def test_partial_batch_after_capture(tmp_path: Path) -> None:
    data = make_data(7 * BATCH + 10).double()
    runs: dict[str, Any] = {"run_settings": {**CUDA, "precision": "64-true"}, "sync_free": None, **SCHEDULE}
    eager = fit(tmp_path / "eager", "topk", False, data, 16, **runs)
    graph = fit(tmp_path / "graph", "topk", True, data, 16, **runs)
    captured(graph[0], 14)
    assert_same_training(eager, graph, "topk", rtol=1e-5)


def test_bf16_mixed_graph(tmp_path: Path) -> None:
    """Autocast inside the capture (its weight cache off): the losses follow the eager run's."""
    data = make_data(STEPS * BATCH)
    runs: dict[str, Any] = {"run_settings": {**CUDA, "precision": "bf16-mixed"}, "sync_free": None, **SCHEDULE}
    eager = fit(tmp_path / "eager", "topk", False, data, STEPS, **runs)
    graph = fit(tmp_path / "graph", "topk", True, data, STEPS, **runs)
    captured(graph[0], STEPS)
    for logged_g, logged_e in zip(graph[2].logged, eager[2].logged, strict=True):
        torch.testing.assert_close(logged_g["train/loss"], logged_e["train/loss"], rtol=5e-2, atol=1e-3)


class CaptureSyncCheck(CudaSyncCheck):
    """Leaves the capture's step unguarded: the one after the `StaticStep`'s eager warm-up runs."""

    def unguarded(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        static = pl_module.graph_step.static
        return static is not None and static.graph is None and static.eager_runs == WARMUP_STEPS


@pytest.mark.parametrize("key", sorted(SAE_REGISTRY))
def test_graph_fit_does_not_sync(tmp_path: Path, key: str) -> None:
    """float32, with the capture wherever it can be (`cuda_graph=None`: on, for one CUDA device)."""
    check = CaptureSyncCheck()
    try:
        module, _, _ = fit(
            tmp_path,
            key,
            None,
            make_data(12 * BATCH),
            12,
            sync_free=None,
            run_settings={**CUDA, "precision": "32-true"},
            callbacks=[check],
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    captured(module, 12)
    assert check.guarded == 12 - 12 // LOG_EVERY - 1
