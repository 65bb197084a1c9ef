"""On a GPU the captured training step (`sae_pipeline.training.graph_step`) trains as the eager step, for
every variant: float64, the warm-up/cosine learning rate changing between replays, a partial batch
falling back for its step; one graph per AuxK plan while latents die and revive; and a ``fit`` with the
graph does not synchronise on the steps Lightning does not log (CUDA's own check, lifted inside captures
only). The CPU counterparts, without capture, are ``tests/test_graph_step.py`` and ``tests/test_auxk_plan.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sae_pipeline.sae import SAE_REGISTRY
from sae_pipeline.sae.topk import TopKSAE
from sae_pipeline.training import graph_step
from tests.test_gpu_sync import CudaSyncCheck
from tests.test_graph_step import BATCH, assert_same_training, fit
from tests.test_module import make_data
from tests.test_sync_free import LOG_EVERY

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = graph_step.WARMUP_STEPS + 6  # eager warm-up, the capture (replayed once), 5 more replays
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


@pytest.fixture
def capture_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's sync check lifted while a graph is captured (`torch.cuda.graph` synchronises once by design):
    the first capture after the warm-up, and one per AuxK plan first seen later (`StaticStep`)."""
    capture = graph_step.StaticStep._capture

    def unchecked(static: graph_step.StaticStep) -> Any:
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return capture(static)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(graph_step.StaticStep, "_capture", unchecked)


@pytest.mark.parametrize("key", sorted(SAE_REGISTRY))
def test_graph_fit_does_not_sync(tmp_path: Path, key: str, capture_unchecked: None) -> None:
    """float32, with the capture wherever it can be (`cuda_graph=None`: on, for one CUDA device)."""
    check = CudaSyncCheck()
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
    assert check.guarded == 12 - 12 // LOG_EVERY


@pytest.mark.parametrize("key", ["topk", "batchtopk", "matryoshka"])
def test_graph_per_auxk_plan(
    tmp_path: Path, key: str, capture_unchecked: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AuxK's plan follows the dead count 2 steps late while latents die and revive: one graph per plan (0,
    no AuxK, among them), the right one replayed each step, trained as the eager step (float64), with no
    sync outside the captures."""
    monkeypatch.setattr(TopKSAE, "aux_lag", 2)
    steps = 16
    data = make_data(steps * BATCH).double()
    runs: dict[str, Any] = {"run_settings": {**CUDA, "precision": "64-true"}, "sync_free": None, **SCHEDULE}
    eager = fit(tmp_path / "eager", key, False, data, steps, **runs)
    check = CudaSyncCheck()
    try:
        graph = fit(tmp_path / "graph", key, True, data, steps, callbacks=[check], **runs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    captured(graph[0], steps)
    static = graph[0].graph_step.static
    assert len(static.graphs) >= 2 and 0 in static.key_runs, static.key_runs
    assert check.guarded == steps - steps // LOG_EVERY
    assert_same_training(eager, graph, key, rtol=1e-5)
