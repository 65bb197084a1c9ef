"""JumpReLU's bf16 encoder (`sae_pipeline/sae/jumprelu_bf16.py`, issue 41 item 5): under bf16 autocast the
encoder GEMM runs in bf16 and only the band of pre-activations that its rounding could carry across θ or
θ ± ε/2 is recomputed in float32, so the firing set and θ's kernel window are the float32 encoder's.

Run on the CPU (``JumpReLUSAE.bf16_encoder = True``; by default the CPU keeps the float32 encoder) at
small shapes with the benchmark's statistics: k-like sparsity, trained-like θ (a per-latent cut, spread),
encoder columns of uneven norms, data at several scales; and on adversarial batches with pre-activations
placed a few bf16 ulps from θ and from the kernel's edges, where a plain bf16 decision flips (checked
too: the test can fail). The Triton kernel runs in a fresh interpreter under ``TRITON_INTERPRET=1``
(`tests/jumprelu_band_checks.py`) and is compiled for sm_90 here; `tests/test_gpu_jumprelu_bf16.py`
checks it on CUDA at the benchmark's shape.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from sae_pipeline.sae import JumpReLUSAE
from sae_pipeline.sae import jumprelu_bf16 as jb
from sae_pipeline.sae.jumprelu import DEFAULT_BANDWIDTH, rectangle
from sae_pipeline.training.module import SAEModule
from sae_pipeline.training.sync_guard import count_host_syncs
from tests.jumprelu_band_checks import adversarial_thresholds, bf16_ulp, trained_like

ROOT = Path(__file__).resolve().parents[1]
BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


def batch(b: int, d_in: int, scale: float, seed: int) -> Tensor:
    """Token-like activations (low rank plus noise, an offset, as `benchmarks/peers.py`) with E‖x‖² = d_in·scale²."""
    g = torch.Generator().manual_seed(seed)
    rank = max(d_in // 4, 1)
    x = torch.randn(b, rank, generator=g) @ (torch.randn(rank, d_in, generator=g) / rank**0.5)
    x = x + 0.1 * torch.randn(b, d_in, generator=g) + torch.randn(d_in, generator=g)
    return x * (scale * math.sqrt(d_in / float(x.square().sum(1).mean())))


def pair(sae: JumpReLUSAE) -> tuple[JumpReLUSAE, JumpReLUSAE]:
    """(float32 encoder, bf16 encoder) copies of ``sae``."""
    f32, b16 = copy.deepcopy(sae), copy.deepcopy(sae)
    f32.bf16_encoder, b16.bf16_encoder = False, True
    return f32, b16


def decisions(sae: JumpReLUSAE, pre: Tensor) -> tuple[Tensor, Tensor]:
    """(firing ``pre > θ``, kernel window ``|pre − θ|/ε < ½``) as `JumpReLUFunction` computes them."""
    threshold, bandwidth = sae.gate()
    pre, threshold = pre.detach().float(), threshold.detach().float()
    return pre > threshold, rectangle((pre - threshold) / bandwidth).bool()


def step(sae: JumpReLUSAE, x: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor], Tensor]:
    """(loss, pre_acts, grads, codes) of one step under bf16 autocast."""
    sae.zero_grad(set_to_none=True)
    with torch.autocast(**BF16):
        output = sae(x)
        loss = sae.loss(x, output).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in sae.named_parameters() if p.grad is not None}
    return loss.detach(), output.pre_acts.detach(), grads, output.codes.detach().float()


CASES = [  # (d_in, d_sae, B, k, scale, seed, token_scaled)
    (64, 512, 512, 8, 1.0, 0, False),
    (128, 1024, 256, 16, 1e-3, 1, False),
    (256, 2048, 1024, 32, 1.0, 2, False),
    (128, 2048, 512, 32, 300.0, 3, True),
    (96, 512, 256, 8, 1.0, 4, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-p{c[1]}-B{c[2]}-k{c[3]}-s{c[4]:g}-ts{int(c[6])}")
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "sparse"])
def test_bf16_encoder_fires_as_the_float32_encoder(case: tuple, dense: bool) -> None:
    d_in, d_sae, b, k, scale, seed, token_scaled = case
    x = batch(b, d_in, scale, seed)
    bandwidth = DEFAULT_BANDWIDTH * (1.0 if token_scaled else scale)  # ε in the data's units, as normalising gives
    f32, b16 = pair(trained_like(d_in, d_sae, x, k, seed, token_scaled_threshold=token_scaled, bandwidth=bandwidth))
    for sae in (f32, b16):
        sae.sync_free = dense  # the GPU's dense path (the backward through the bf16 GEMMs), or the CPU's sparse one
    loss32, pre32, grads32, codes32 = step(f32, x)
    loss16, pre16, grads16, codes16 = step(b16, x)
    assert pre16.dtype == torch.float32 and b16.uses_bf16_encoder(x) is False  # autocast is off out here
    fire32, window32 = decisions(f32, pre32)
    fire16, window16 = decisions(b16, pre16)
    assert torch.equal(fire16, fire32) and torch.equal(codes16 != 0, codes32 != 0)
    assert torch.equal(window16, window32)
    l0 = float(fire32.sum()) / b
    assert k / 2 <= l0 <= 2 * k, l0  # the sparsity the case is about
    assert 0 < int((pre16 != pre32).sum())  # the bf16 GEMM's values outside the band
    torch.testing.assert_close(loss16, loss32, rtol=2e-2, atol=0)
    torch.testing.assert_close(codes16, codes32, rtol=0, atol=4e-3 * float(codes32.abs().max()))
    for name, grad in grads32.items():
        error = float((grads16[name] - grad).norm() / grad.norm().clamp_min(1e-30))
        assert error < 2e-2, (name, error)
    # θ's straight-through gradient: the same entries in its window, so the same latents get one
    assert torch.equal(grads16["log_threshold"] != 0, grads32["log_threshold"] != 0)


@pytest.mark.parametrize("where", ["theta", "upper edge", "lower edge"])
@pytest.mark.parametrize("seed", [0, 1])
def test_adversarial_entries_a_few_bf16_ulps_from_a_cut(where: str, seed: int) -> None:
    """Every latent has one entry placed 0, ±1, ... ±4 bf16 ulps from θ (or from θ ± ε/2): the float32 encoder
    decides them one way, the bf16 GEMM's value (no recompute) often the other, ours as float32."""
    d_in, d_sae, b, k = 128, 1024, 512, 16
    x = batch(b, d_in, 1.0, seed)
    f32, b16 = pair(trained_like(d_in, d_sae, x, k, seed))
    with torch.no_grad():
        pre = f32.pre_activations(x)
        offset = {"theta": 0.0, "upper edge": -f32.bandwidth / 2, "lower edge": f32.bandwidth / 2}[where]
        log_threshold = adversarial_thresholds(pre, k, offset, seed)
        f32.log_threshold.copy_(log_threshold)
        b16.log_threshold.copy_(log_threshold)
        pre32 = f32.pre_activations(x)
        distance = (pre32 - f32.threshold - (-offset)) / bf16_ulp(f32.threshold)
        assert int((distance.abs() <= 4.01).sum()) >= d_sae  # the placed entries are there
    _, pre_ours, _, _ = step(b16, x)
    cut = 0 if where == "theta" else 1
    assert torch.equal(decisions(b16, pre_ours)[cut], decisions(f32, pre32)[cut])
    assert torch.equal(decisions(b16, pre_ours)[1 - cut], decisions(f32, pre32)[1 - cut])
    # the test can fail: without the recompute the same batch decides otherwise
    with torch.no_grad():
        a = x - f32.b_pre
        plain = jb._mm32(a.bfloat16(), f32.W_enc.bfloat16()) + f32.b_enc
        with torch.autocast(**BF16):
            autocast_plain = torch.addmm(f32.b_enc, a, f32.W_enc).float()
    for value in (plain, autocast_plain):
        flips = int((decisions(f32, value)[cut] != decisions(f32, pre32)[cut]).sum())
        assert flips >= 10, flips


def test_without_the_band_the_firing_set_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same path with an empty band (the bf16 GEMM's decisions) fails the equality above."""
    d_in, d_sae, b, k = 128, 1024, 512, 16
    x = batch(b, d_in, 1.0, 0)
    f32, b16 = pair(trained_like(d_in, d_sae, x, k, 0))
    with torch.no_grad():
        pre = f32.pre_activations(x)
        for sae in (f32, b16):
            sae.log_threshold.copy_(adversarial_thresholds(pre, k, 0.0, 0))
    fire32 = decisions(f32, step(f32, x)[1])[0]
    monkeypatch.setattr(jb, "band_mask", lambda pre, *args: torch.zeros_like(pre, dtype=torch.bool))
    fire16 = decisions(b16, step(b16, x)[1])[0]
    assert int((fire16 != fire32).sum()) >= 10


@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e4])
def test_rounding_bound_holds_and_the_band_stays_narrow(scale: float) -> None:
    """|p − p₃₂| ≤ δ on every entry (δ the module docstring's bound, here without the safety factor), with
    margin; the band holds about as many entries as fire (a few times at most)."""
    d_in, d_sae, b, k = 256, 2048, 512, 32
    x = batch(b, d_in, scale, 5)
    sae = trained_like(d_in, d_sae, x, k, 5)
    with torch.no_grad():
        a = x - sae.b_pre
        pre32 = torch.addmm(sae.b_enc, a, sae.W_enc)
        a16, W16 = a.bfloat16(), sae.W_enc.bfloat16()
        p = jb._mm32(a16, W16) + sae.b_enc
        rows, cols = jb.bound_terms(a, a16, sae.W_enc, W16, sae.b_enc)
        delta = (torch.addmm(cols[2], rows, cols[:2]) + jb.SAFETY * jb.F32_UNIT * p.abs()) / jb.SAFETY
        ratio = (p - pre32).abs() / delta
        assert float(ratio.max()) < 0.5, float(ratio.max())  # a bound, not an estimate: typical errors are far below
        band = jb.band_mask(p, sae.threshold, DEFAULT_BANDWIDTH * scale / 2, rows, cols)  # ε in the data's units
        fired = pre32 > sae.threshold
    assert 0 < int(band.sum()) <= 4 * int(fired.sum())


def test_cpu_keeps_the_float32_encoder_unless_asked() -> None:
    x = batch(64, 32, 1.0, 0)
    sae = JumpReLUSAE(32, 128, sparsity_loss="target_l0", target_l0=8)
    assert not sae.uses_bf16_encoder(x)  # no autocast
    with torch.autocast(**BF16):
        assert not sae.uses_bf16_encoder(x)  # the CPU's default
        sae.bf16_encoder = True
        assert not sae.train().uses_bf16_encoder(x)  # θ is calibrated on this batch: float32
        sae._calibration_pending = False
        assert sae.uses_bf16_encoder(x) and not sae.uses_bf16_encoder(x.double())
    with torch.autocast("cpu", dtype=torch.float16):
        assert not sae.uses_bf16_encoder(x)
    sae.bf16_encoder = False
    with torch.autocast(**BF16):
        assert not sae.uses_bf16_encoder(x)


def test_calibration_batch_reads_float32_pre_activations() -> None:
    x = batch(256, 64, 1.0, 0)
    thresholds = []
    for flag in (False, True):
        torch.manual_seed(0)
        sae = JumpReLUSAE(64, 512, sparsity_loss="target_l0", target_l0=8).train()
        sae.bf16_encoder = flag
        sae.init_b_pre(x.mean(0))
        with torch.autocast(**BF16):
            sae(x)
        thresholds.append(sae.threshold.detach())
    assert torch.equal(thresholds[0], thresholds[1])


def test_kernel_failure_falls_back_to_the_float32_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that cannot compile or launch (here: compiled Triton on CPU tensors) costs speed, not the
    result: this call takes the torch path (one warning), later calls the float32 encoder."""
    monkeypatch.setattr(jb, "use_triton", True)
    d_in, d_sae, b, k = 64, 512, 128, 8
    x = batch(b, d_in, 1.0, 0)
    sae = trained_like(d_in, d_sae, x, k, 0)
    a = (x - sae.b_pre).detach()
    args = (a, sae.W_enc, sae.b_enc, sae.threshold.detach(), None, sae.bandwidth / 2)
    with torch.no_grad():
        reference = jb.Bf16Encoder.apply(*args, False)
        if jb.triton is not None:
            with pytest.warns(RuntimeWarning, match="band kernel failed"):
                fallback = jb.Bf16Encoder.apply(*args, True)
            torch.testing.assert_close(fallback, reference, rtol=0, atol=0)
            assert not jb.kernel_available()  # so `uses_bf16_encoder` says no on CUDA from now on


def test_bf16_step_does_not_sync() -> None:
    """The band is a mask and a ``torch.where`` (the kernel on a GPU): no host read, no data-sized tensor."""
    d_in, d_sae, b, k = 64, 512, 256, 8
    x = batch(b, d_in, 1.0, 0)
    sae = pair(trained_like(d_in, d_sae, x, k, 0, token_scaled_threshold=True))[1]
    sae.sync_free = True
    with sae.finite_checked_by_caller(), count_host_syncs() as calls:  # the module checks the batch itself
        with torch.autocast(**BF16):
            output = sae(x)
            loss = sae.loss(x, output).loss
        loss.backward()
    assert calls == [], calls


def test_training_module_runs_the_bf16_encoder_under_bf16_mixed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through Lightning's ``bf16-mixed`` (the backbone configs' precision) and the sync-free step: every step
    but the first (θ calibrated on it, in float32) runs the bf16 encoder, and no step Lightning does not log
    reads the device (`tests/test_sync_free.py`'s guard)."""
    from tests.test_sync_free import STEPS, build, fit_guarded, initialised, make_data

    sae = build("jumprelu", sync_free=True)
    sae.bf16_encoder = True
    calls: list[bool] = []
    forward = jb.Bf16Encoder.forward

    def counted(*args: object) -> Tensor:
        calls.append(True)
        return forward(*args)

    monkeypatch.setattr(jb.Bf16Encoder, "forward", staticmethod(counted))
    data = make_data(STEPS * 32)
    guard = fit_guarded(tmp_path, initialised(SAEModule(sae, warmup_steps=0), data), data, precision="bf16-mixed")
    assert guard.calls == [], sorted(set(guard.calls))
    assert len(calls) == STEPS - 1
    l0 = float((sae.encode(data) != 0).sum(1).float().mean())
    assert 2 <= l0 <= 32, l0


def test_kernel_compiles_for_hopper() -> None:
    """The band kernel compiles to sm_90 machine code without a GPU (Triton's own ptxas), in all four
    variants of its constants: a kernel that fails there would only warn at run time."""
    pytest.importorskip("triton")
    from tests.jumprelu_band_checks import compile_for

    try:
        sizes = compile_for(90)
    except (FileNotFoundError, RuntimeError) as exn:  # no ptxas with this Triton build
        if "ptxas" in str(exn):
            pytest.skip(str(exn))
        raise
    assert len(sizes) == 4 and all(size > 0 for size in sizes)


@pytest.mark.slow  # a fresh interpreter (torch import) and the Triton interpreter: ~30 s
def test_kernel_matches_the_torch_path_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.jumprelu_band_checks"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    checked = result.stdout.split("checked:")[-1].split()
    assert len(checked) == 8, result.stdout
