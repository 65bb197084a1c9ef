"""The captured training step (`sae_pipeline.training.graph_step`) computes what Lightning's eager step
computes. On the CPU the `StaticStep` runs its callable without capture (``CAPTURE_DEVICES`` widened), in
float64 against the module's eager step: weights, buffers, Adam's state, the logged metrics, with the
warm-up/cosine learning rate changing every step. The capture itself is checked on a GPU
(``tests/test_gpu_graph_step.py``)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from sae_pipeline.training import graph_step, lightning_compat
from sae_pipeline.training.module import NonFiniteBatchError, SAEModule
from tests.test_module import make_data, memory_loader, trainer
from tests.test_sync_free import LOG_EVERY, build, initialised

BATCH = 32


class Recorder(L.Callback):
    """The metrics Lightning writes on each logging step."""

    def __init__(self) -> None:
        self.logged: list[dict[str, Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if lightning_compat.should_update_logs(trainer):
            self.logged.append({name: value.clone() for name, value in trainer.callback_metrics.items()})


def loader(data: Tensor) -> DataLoader:
    """Batches of 32 in order, the last one partial when ``len(data)`` is not a multiple."""
    return DataLoader(
        list(range(len(data))),
        batch_size=BATCH,
        collate_fn=lambda rows: {"x": data[rows].clone(), "shards": [f"shard-{rows[0] // BATCH:06d}.tar"]},
    )


def fit(
    tmp_path: Path,
    key: str,
    cuda_graph: bool | None,
    data: Tensor,
    steps: int,
    sync_free: bool | None = True,
    run_settings: dict[str, Any] | None = None,
    callbacks: list[L.Callback] | None = None,
    **settings: Any,
) -> tuple[SAEModule, L.Trainer, Recorder]:
    sae = build(key, sync_free=sync_free)
    if key == "relu":
        sae.l1_warmup_steps = 4
    module = initialised(SAEModule(sae, cuda_graph=cuda_graph, **settings), data)
    recorder = Recorder()
    run_settings = {"precision": "64-true", **(run_settings or {})}
    run = trainer(
        tmp_path, max_steps=steps, log_every_n_steps=LOG_EVERY, callbacks=[recorder, *(callbacks or [])], **run_settings
    )
    run.fit(module, loader(data))
    return module, run, recorder


def assert_same_training(
    eager: tuple[SAEModule, L.Trainer, Recorder], static: tuple[Any, ...], key: str, rtol: float = 1e-10
) -> None:
    """Same weights, buffers, Adam moments and step counts, logged metrics, to float64 rounding (capturable
    Adam computes its bias corrections as tensors)."""
    (module_e, run_e, rec_e), (module_s, run_s, rec_s) = eager, static
    close = {"rtol": rtol, "atol": rtol / 100}
    for name, value in module_e.sae.state_dict().items():
        torch.testing.assert_close(module_s.sae.state_dict()[name], value, **close, msg=f"{key}: {name}")
    state_e, state_s = run_e.optimizers[0].state_dict()["state"], run_s.optimizers[0].state_dict()["state"]
    assert state_e.keys() == state_s.keys()
    for index, moments in state_e.items():
        for name, value in moments.items():
            torch.testing.assert_close(state_s[index][name].to(value), value, **close, msg=f"{key}: Adam {name}")
    assert len(rec_s.logged) == len(rec_e.logged) > 0
    for logged_s, logged_e in zip(rec_s.logged, rec_e.logged, strict=True):
        assert logged_s.keys() == logged_e.keys()
        for name, value in logged_e.items():
            torch.testing.assert_close(logged_s[name].to(value), value, **close, msg=f"{key}: {name}")


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The `StaticStep` path on the CPU, without capture."""
    monkeypatch.setattr(graph_step, "CAPTURE_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize(
    ("key", "settings"),
    [
        ("topk", {}),  # AuxK with dead latents
        ("jumprelu", {}),  # two Adam groups (the threshold's learning-rate scale)
        ("mpsae", {}),
    ],
)
def test_static_step_trains_as_the_eager_step(tmp_path: Path, on_cpu: None, key: str, settings: dict) -> None:
    data = make_data(7 * BATCH).double()
    schedule = {"warmup_steps": 3, "lr": 1e-2, "min_lr": 1e-4}  # the learning rate changes every step
    eager = fit(tmp_path / "eager", key, False, data, 7, **schedule)
    static = fit(tmp_path / "static", key, None, data, 7, **schedule)
    assert eager[0].graph_step.static is None
    assert static[0].graph_step.static is not None and static[0].graph_step.static.runs == 7
    assert_same_training(eager, static, key)
    group = static[1].optimizers[0].param_groups[0]
    assert group["capturable"] and isinstance(group["lr"], Tensor)
    lr = torch.tensor(eager[1].optimizers[0].param_groups[0]["lr"], dtype=torch.float64)
    torch.testing.assert_close(group["lr"], lr, rtol=1e-12, atol=0.0)


def test_partial_batch_runs_eagerly_and_trains_the_same(
    tmp_path: Path, on_cpu: None, caplog: pytest.LogCaptureFixture
) -> None:
    """7 full batches and a partial one per epoch, two epochs: the partial ones run eagerly (said once), the
    others through the static step, and the run is the eager run."""
    data = make_data(7 * BATCH + 10).double()
    schedule = {"warmup_steps": 2, "lr": 1e-2}
    with caplog.at_level(logging.INFO):
        static = fit(tmp_path / "static", "topk", None, data, 16, **schedule)
    eager = fit(tmp_path / "eager", "topk", False, data, 16, **schedule)
    assert static[0].graph_step.static is not None and static[0].graph_step.static.runs == 14
    said = [record.getMessage() for record in caplog.records if "is not the captured" in record.getMessage()]
    assert said == ["a batch of shape [10, 16] (torch.float64) is not the captured [32, 16]: eager steps for it"]
    assert_same_training(eager, static, "topk")


def test_relu_warmup_runs_eagerly_until_it_ends(tmp_path: Path, on_cpu: None) -> None:
    """ReLU's λ changes every step of its warm-up: those steps are eager, the later ones static."""
    data = make_data(7 * BATCH).double()
    eager = fit(tmp_path / "eager", "relu", False, data, 7)
    static = fit(tmp_path / "static", "relu", None, data, 7)
    assert eager[0].sae.l1_warmup_steps == static[0].sae.l1_warmup_steps == 4
    assert static[0].graph_step.static is not None and static[0].graph_step.static.runs == 3  # steps 4, 5, 6
    assert_same_training(eager, static, "relu")


def test_cpu_fallback_says_so_once(tmp_path: Path) -> None:
    data = make_data(6 * BATCH)
    module = initialised(SAEModule(build("topk", sync_free=None), cuda_graph=True, warmup_steps=0), data)
    before = module.sae.W_dec.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = trainer(tmp_path, max_steps=6)
        run.fit(module, memory_loader(data))
    said = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    assert said == ["the training step runs eagerly, not as a CUDA graph: the device is cpu, not CUDA"]
    assert run.global_step == 6 and not torch.equal(module.sae.W_dec, before)
    assert module.graph_step.static is None


def test_default_is_silent_on_the_cpu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = make_data(3 * BATCH)
    module = initialised(SAEModule(build("topk", sync_free=None)), data)
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, max_steps=3).fit(module, memory_loader(data))
    assert not [w for w in caught if "CUDA graph" in str(w.message)]
    assert "CUDA graph" not in caplog.text
    assert module.graph_step.static is None


def test_checkpoint_is_an_eager_runs(tmp_path: Path, on_cpu: None) -> None:
    """Learning rates saved as numbers and ``capturable`` off, so an eager (or CPU) run resumes it, and a
    graph run resumed from it prepares Adam again."""
    data = make_data(4 * BATCH).double()
    module, run, _ = fit(tmp_path, "topk", None, data, 4, warmup_steps=2)
    run.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    for group in saved["optimizer_states"][0]["param_groups"]:
        assert type(group["lr"]) is float and group["capturable"] is False
    assert isinstance(run.optimizers[0].param_groups[0]["lr"], Tensor)  # the live optimizer is untouched
    for cuda_graph in (False, None):
        resumed = initialised(SAEModule(build("topk", sync_free=True), cuda_graph=cuda_graph, warmup_steps=2), data)
        again = trainer(tmp_path / str(cuda_graph), precision="64-true", max_steps=6)
        again.fit(resumed, loader(data), ckpt_path=tmp_path / "last.ckpt")
        assert again.global_step == 6
    assert resumed.graph_step.static is not None and resumed.graph_step.static.runs == 2


def test_non_finite_batch_is_named_from_the_static_step(tmp_path: Path, on_cpu: None) -> None:
    module = SAEModule(build("topk", sync_free=True), warmup_steps=0, cuda_graph=None)
    with pytest.raises(NonFiniteBatchError, match="global step 3: batch from shards shard-000003.tar"):
        trainer(tmp_path, max_steps=8, log_every_n_steps=3).fit(
            module, memory_loader(make_data(8 * 32), nan_at_batch=3)
        )
    assert module.graph_step.static is not None and module.graph_step.static.runs == 6
