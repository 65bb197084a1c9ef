"""AuxK where host reads are avoided (a GPU, and so the CUDA graph step): planned from a dead count the host
knows ``aux_lag`` steps late (`sae_pipeline.sae.late_count`), no AuxK work at all while that count is 0, the
top-``k_aux`` over the dead latents only otherwise.

Checked on the CPU with ``sync_free=True`` (the GPU's code): the loss and the gradients of W_enc, b_enc,
W_dec and b_pre against AuxK written plainly below (float64, fresh random inputs); the missing work with
no dead latent (the calls counted); the lag (on after a latent dies, off after it revives); the captured
step's choice of graph per plan (without capture on the CPU; a stand-in graph that replays its capture's
plan, so that a wrong choice shows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from sae_pipeline.sae import get_sae_class
from sae_pipeline.sae import topk as topk_module
from sae_pipeline.sae.late_count import LateCount
from sae_pipeline.sae.topk import TopKSAE, aux_slots
from sae_pipeline.training import graph_step
from sae_pipeline.training.module import SAEModule
from tests.test_graph_step import BATCH, assert_same_training, fit
from tests.test_module import make_data, memory_loader, trainer
from tests.test_sync_free import initialised

D_IN, D_SAE, K, K_AUX, ALPHA = 16, 64, 4, 8, 0.5
VARIANTS = ("topk", "batchtopk", "matryoshka")
PARAMS = ("W_enc", "b_enc", "W_dec", "b_pre")


def reference_auxk(sae: Any, x: Tensor, x_hat: Tensor, dead: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """AuxK as defined (Gao et al. 2024), dense, float64: the top ``k_aux`` of ``relu(pre)`` among the dead
    latents (live ones masked to -inf, a masked pick worth 0), decoded without ``b_pre``, against the
    detached residual ``x − x_hat``; 0 with no dead latent. Returns the loss and its gradients."""
    params = {name: getattr(sae, name).detach().clone().requires_grad_(True) for name in PARAMS}
    pre = (x - params["b_pre"]) @ params["W_enc"] + params["b_enc"]
    masked = torch.where(dead, F.relu(pre), float("-inf"))
    values, indices = masked.topk(sae.k_aux, dim=-1)
    values = torch.where(torch.isfinite(values), values, 0.0)
    codes = torch.zeros_like(pre).scatter(-1, indices, values)
    loss = sae.aux_coefficient * F.mse_loss(codes @ params["W_dec"], (x - x_hat).detach())
    if not bool(dead.any()):
        loss = loss * 0.0
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss.detach(), dict(zip(PARAMS, grads, strict=True))


def make_sae(key: str, seed: int, dense: bool = False) -> Any:
    """A float64 SAE with random weights (biases not 0), on the GPU's code (``sync_free=True``)."""
    torch.manual_seed(seed)
    sae = get_sae_class(key)(D_IN, D_SAE, k=K, k_aux=K_AUX, aux_coefficient=ALPHA, dead_after_tokens=10).double()
    with torch.no_grad():
        sae.W_enc.add_(0.3 * torch.randn_like(sae.W_enc))
        sae.b_enc.copy_(0.2 * torch.randn_like(sae.b_enc))
        sae.b_pre.copy_(0.5 * torch.randn_like(sae.b_pre))
        sae.W_dec.add_(0.3 * torch.randn_like(sae.W_dec))
        sae.normalize_atoms()
    sae.sync_free = True
    if dense:
        sae.sparse_max_density = 0.0
    return sae


def kill(sae: Any, latents: Tensor) -> Tensor:
    """Mark ``latents`` dead (their clocks at ``dead_after_tokens``); returns the dead mask."""
    sae.tokens_since_fired.zero_()
    sae.tokens_since_fired[latents] = sae.dead_after_tokens
    return sae.dead_mask()


def sae_auxk(sae: Any, x: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``(x_hat, AuxK loss, its gradients)`` of the SAE's own code, after its plan for the step."""
    output = sae(x)
    loss = sae.auxiliary_loss(x, output)
    params = [getattr(sae, name) for name in PARAMS]
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    else:
        grads = (None,) * len(params)
    zeros = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    return output.x_hat.detach(), loss.detach(), dict(zip(PARAMS, zeros, strict=True))


def assert_matches_reference(sae: Any, x: Tensor, x_hat: Tensor, loss: Tensor, grads: dict, dead: Tensor) -> None:
    expected_loss, expected_grads = reference_auxk(sae, x, x_hat, dead)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-13)
    for name in PARAMS:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-10, atol=1e-13, msg=name)


# --- the loss and its gradients -----------------------------------------------------------------------
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("key", VARIANTS)
@pytest.mark.parametrize(("n_dead", "slots"), [(0, 0), (3, 4), (20, 32), (60, 64)])
def test_planned_auxk_is_the_reference(key: str, dense: bool, n_dead: int, slots: int) -> None:
    """None dead (no AuxK), few (fewer than k_aux: padded picks), many (more than k_aux), nearly all (the
    slots reach d_sae: all latents, the live ones masked). The plan is the fit's: `begin_fit`'s count."""
    for seed in range(3):
        sae = make_sae(key, seed, dense)
        x = torch.randn(48, D_IN, dtype=torch.float64) * 2.0 + 0.5
        dead = kill(sae, torch.randperm(D_SAE)[:n_dead])
        sae.begin_fit()
        assert sae.plan_step() == slots == sae.planned_aux_slots
        x_hat, loss, grads = sae_auxk(sae, x)
        assert (float(loss) > 0) == (n_dead > 0)
        assert_matches_reference(sae, x, x_hat, loss, grads, dead)


@pytest.mark.parametrize("key", VARIANTS)
def test_stale_plans(key: str) -> None:
    """A plan made from another count than the device's: fewer slots than dead latents cover the first
    dead latents exactly (the reference over those); more slots pad with picks worth 0; slots with no dead
    latent on the device give 0 and no gradient; a plan of 0 skips AuxK."""
    sae = make_sae(key, seed=7)
    x = torch.randn(40, D_IN, dtype=torch.float64)
    latents = torch.tensor([2, 9, 11, 30, 31, 40, 41, 47, 50, 52, 60, 63])
    dead = kill(sae, latents)
    for planned, covered in ((4, latents[:4]), (8, latents[:8]), (16, latents), (64, latents)):
        sae.planned_aux_slots = planned
        x_hat, loss, grads = sae_auxk(sae, x)
        covered_mask = torch.zeros_like(dead)
        covered_mask[covered] = True
        assert_matches_reference(sae, x, x_hat, loss, grads, covered_mask)
    kill(sae, torch.tensor([], dtype=torch.int64))
    sae.planned_aux_slots = 16
    _, loss, grads = sae_auxk(sae, x)
    assert float(loss) == 0 and all(not bool(g.any()) for g in grads.values())
    kill(sae, latents)
    sae.planned_aux_slots = 0
    _, loss, _ = sae_auxk(sae, x)
    assert float(loss) == 0 and not loss.requires_grad


def test_cpu_path_reads_the_count_and_matches() -> None:
    """On the CPU (``sync_free`` False) the count is read each step: the same loss and gradients."""
    for n_dead in (0, 3, 20, 60):
        sae = make_sae("topk", seed=n_dead)
        sae.sync_free = False
        x = torch.randn(32, D_IN, dtype=torch.float64)
        dead = kill(sae, torch.randperm(D_SAE)[:n_dead])
        x_hat, loss, grads = sae_auxk(sae, x)
        assert_matches_reference(sae, x, x_hat, loss, grads, dead)


def test_aux_slots() -> None:
    assert [aux_slots(n, 100) for n in (0, 1, 2, 3, 4, 5, 33, 64, 65, 100)] == [0, 1, 2, 4, 4, 8, 64, 64, 100, 100]
    assert aux_slots(None, 100) is None


# --- the work that is not done --------------------------------------------------------------------
class CallCounter(TorchFunctionMode):
    """How often each torch function is called from Python."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("key", VARIANTS)
def test_no_auxk_work_without_dead_latents(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sync-free, forward + loss + backward: with no dead latent only the forward's top-k runs (before, a
    second top-k over all [B, d_sae] and AuxK's sparse decode ran every step, to be masked to 0); with some,
    AuxK's top-k, its sparse decode and its `nonzero_static` run once."""
    decodes: list[int] = []
    decode = topk_module.sparse_decode
    monkeypatch.setattr(topk_module, "sparse_decode", lambda *a, **k: decodes.append(1) or decode(*a, **k))
    x = torch.randn(32, D_IN, dtype=torch.float64)
    for n_dead, aux_calls in ((0, 0), (5, 1)):
        sae = make_sae(key, seed=1)
        kill(sae, torch.arange(n_dead))
        sae.begin_fit()
        sae.plan_step()
        decodes.clear()
        with CallCounter() as counter:
            sae.loss(x, sae(x)).loss.backward()
        assert counter.calls.get("topk", 0) == 1 + aux_calls, counter.calls.get("topk")
        assert counter.calls.get("nonzero_static", 0) == aux_calls
        assert len(decodes) == aux_calls


def test_no_auxk_work_in_a_sync_free_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync-free fit whose latents never die: AuxK's sparse decode is never called; the same fit with
    latents dead from the start calls it every step."""
    decodes: list[int] = []
    decode = topk_module.sparse_decode
    monkeypatch.setattr(topk_module, "sparse_decode", lambda *a, **k: decodes.append(1) or decode(*a, **k))
    data = make_data(6 * BATCH)
    for n_dead, expected in ((0, 0), (D_SAE // 2, 6)):
        torch.manual_seed(0)
        sae = TopKSAE(D_IN, D_SAE, k=K, dead_after_tokens=10**9)
        sae.sync_free = True
        sae.tokens_since_fired[:n_dead] = sae.dead_after_tokens
        decodes.clear()
        trainer(tmp_path, max_steps=6).fit(initialised(SAEModule(sae, warmup_steps=0), data), memory_loader(data))
        assert len(decodes) == expected


# --- the lag -----------------------------------------------------------------------------------------
def test_plan_follows_the_dead_count_lag_steps_late() -> None:
    """A latent that dies in step 1 (dead from step 2) turns AuxK on at step 2 + lag; revived in step 6
    (alive from step 7), AuxK stops at step 7 + lag."""
    sae = TopKSAE(D_IN, D_SAE, k=K, dead_after_tokens=10)
    sae.sync_free = True
    sae.aux_lag = 3
    sae.begin_fit()
    plans = []
    for step in range(12):
        plans.append(sae.plan_step())
        if step == 1:
            sae.tokens_since_fired[5] = sae.dead_after_tokens  # what record_firing does in the step
        if step == 6:
            sae.tokens_since_fired[5] = 0
        sae.after_step()
    assert plans == [0] * 5 + [1] * 5 + [0] * 2


def test_late_count() -> None:
    late = LateCount(lag=2)
    late.reset(5, torch.device("cpu"))
    seen = []
    for step in range(6):
        seen.append(late.read())
        late.push(torch.tensor(10 + step))
    assert seen == [5, 5, 5, 10, 11, 12]  # step t sees the push of step t - 1 - lag
    for _ in range(4):  # pushes without reads: the oldest unread copy is read before its slot is reused
        late.push(torch.tensor(99))
    assert late.read() == 99 and late.value == 99
    with pytest.raises(ValueError, match="lag"):
        LateCount(lag=0)


class PlanRecorder(L.Callback):
    """The dead count at each step's start (before the step) and the step's plan."""

    def __init__(self) -> None:
        self.dead: list[int] = []
        self.plans: list[int | None] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.dead.append(int(pl_module.sae.dead_mask().sum()))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.plans.append(pl_module.sae.planned_aux_slots)


@pytest.mark.parametrize("key", VARIANTS)
def test_fit_plans_with_the_count_of_lag_steps_before(tmp_path: Path, key: str) -> None:
    """Through Lightning: step t's plan is the count at the start of step max(t − lag, 0) (the fit's first
    steps use the count read when it starts), while latents die and revive every few steps."""
    torch.manual_seed(0)
    sae = get_sae_class(key)(D_IN, D_SAE, k=K, dead_after_tokens=64)
    sae.sync_free, sae.aux_lag = True, 2
    sae.tokens_since_fired[: D_SAE // 2] = sae.dead_after_tokens
    data = make_data(16 * BATCH)
    recorder = PlanRecorder()
    trainer(tmp_path, max_steps=16, callbacks=[recorder]).fit(
        initialised(SAEModule(sae, warmup_steps=0), data), memory_loader(data)
    )
    expected = [aux_slots(recorder.dead[max(t - 2, 0)], D_SAE) for t in range(16)]
    assert recorder.plans == expected
    assert len(set(recorder.dead)) > 2  # the count moved


# --- the captured step: one graph per plan ------------------------------------------------------------
class ReplayedGraph:
    """Stands in for a CUDA graph on the CPU: a replay runs the step with the plan of its capture (what a
    captured graph bakes in), whatever the SAE planned for this step."""

    def __init__(self, static: Any) -> None:
        self.static, self.plan = static, static.module.sae.planned_aux_slots

    def replay(self) -> None:
        sae = self.static.module.sae
        planned, sae.planned_aux_slots = sae.planned_aux_slots, self.plan
        try:
            self.static.outputs = self.static._step()
        finally:
            sae.planned_aux_slots = planned


class CPUCaptureStep(graph_step.StaticStep):
    """`StaticStep` with capture on the CPU: warm-ups run the step, a capture runs nothing (as on CUDA)."""

    def __init__(self, module: Any, optimizer: torch.optim.Optimizer, capture: bool) -> None:
        super().__init__(module, optimizer, capture=True)
        self.actions: list[tuple[Any, str]] = []

    def action(self, key: Any) -> str:
        chosen = super().action(key)
        self.actions.append((key, chosen))
        return chosen

    def _warm_up(self) -> tuple[Tensor, Any, Any]:
        return self._step()

    def _capture(self) -> tuple[Any, Any]:
        return ReplayedGraph(self), None


class OneGraphStep(CPUCaptureStep):
    """A wrong step: one graph whatever the plan (the first captured)."""

    def run(self, batch: dict[str, Any], step: int, key: Any = None) -> Any:
        return super().run(batch, step, None)


@pytest.fixture
def lag_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TopKSAE, "aux_lag", 2)
    monkeypatch.setattr(graph_step, "CAPTURE_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize("key", VARIANTS)
def test_static_step_without_capture_follows_the_plan(tmp_path: Path, lag_2: None, key: str) -> None:
    """capture=False (the CPU): the static step trains as the eager step while the plan changes (float64),
    each run with the SAE's plan as its key."""
    data = make_data(14 * BATCH).double()
    schedule = {"warmup_steps": 3, "lr": 1e-2, "min_lr": 1e-4}
    eager = fit(tmp_path / "eager", key, False, data, 14, **schedule)
    static = fit(tmp_path / "static", key, None, data, 14, **schedule)
    step = static[0].graph_step.static
    assert step is not None and step.runs == 14 and step.graphs == {}
    assert len(step.key_runs) >= 3 and 0 in step.key_runs, step.key_runs  # AuxK off, and on with several sizes
    assert_same_training(eager, static, key)


def test_captured_step_replays_the_graph_of_its_plan(
    tmp_path: Path, lag_2: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With stand-in captures: each plan captured once, after one eager step of it (the first capture after
    `WARMUP_STEPS`), then replayed; trained as the eager step. One graph for every plan trains otherwise."""
    data = make_data(14 * BATCH).double()
    schedule = {"warmup_steps": 3, "lr": 1e-2, "min_lr": 1e-4}
    eager = fit(tmp_path / "eager", "topk", False, data, 14, **schedule)
    monkeypatch.setattr(graph_step, "StaticStep", CPUCaptureStep)
    static = fit(tmp_path / "static", "topk", None, data, 14, **schedule)
    step = static[0].graph_step.static
    assert isinstance(step, CPUCaptureStep) and step.runs == 14
    actions = step.actions
    assert [chosen for _, chosen in actions[: graph_step.WARMUP_STEPS]] == ["eager"] * graph_step.WARMUP_STEPS
    captured = [key for key, chosen in actions if chosen == "capture"]
    assert len(captured) == len(set(captured)) == len(step.graphs) >= 2, actions
    for plan in captured:
        runs = [chosen for key, chosen in actions if key == plan]
        first = runs.index("capture")
        assert "eager" in runs[:first] and set(runs[first + 1 :]) <= {"replay"}, (plan, actions)
    assert_same_training(eager, static, "topk")

    monkeypatch.setattr(graph_step, "StaticStep", OneGraphStep)
    wrong = fit(tmp_path / "wrong", "topk", None, data, 14, **schedule)
    assert len(wrong[0].graph_step.static.graphs) == 1
    with pytest.raises(AssertionError):
        assert_same_training(eager, wrong, "topk")
