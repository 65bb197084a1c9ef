"""JumpReLU's bf16 encoder on CUDA (a lent GPU) at the benchmark's shape (`benchmarks/gpu.py`: d_in 768, d_sae
19 200, B 4 096, L0 ≈ 32): the band kernel against the torch path (`tests/jumprelu_band_checks.py`), the
training step under bf16 autocast against the float32 encoder's (the firing set and θ's kernel window
equal up to float32's own rounding, the gradients to bf16's), without a host sync, and faster."""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch

from sae_pipeline.sae import JumpReLUSAE
from sae_pipeline.sae import jumprelu_bf16 as jb
from tests.jumprelu_band_checks import float_ambiguity, interpreted_checks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")
D_IN, D_SAE, BATCH, K = 768, 19200, 4096, 32


def test_kernel_matches_the_torch_path_on_cuda() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel failure warns (and falls back): here it fails the test
        checked = interpreted_checks("cuda", (D_IN, D_SAE, BATCH), K)
    assert len(checked) == 8


def benchmark_sae() -> tuple[JumpReLUSAE, torch.Tensor]:
    """As `benchmarks/gpu.py` builds it: b_pre at the batch mean, one θ with B·k entries above it."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, D_IN, device="cuda") + torch.randn(D_IN, device="cuda")
    sae = JumpReLUSAE(D_IN, D_SAE).cuda()
    sae.init_b_pre(x.mean(0))
    with torch.no_grad():
        top = sae.pre_activations(x).flatten().topk(BATCH * K + 1).values
        sae.log_threshold.fill_(float(((top[-1] + top[-2]) / 2).log()))
    return sae.train(), x


def run(sae: JumpReLUSAE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    sae.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        output = sae(x)
        loss = sae.loss(x, output).loss
    loss.backward()
    return loss.detach(), output.pre_acts.detach(), {n: p.grad.clone() for n, p in sae.named_parameters()}


def test_step_fires_as_the_float32_encoder_without_a_sync_and_faster() -> None:
    template, x = benchmark_sae()
    f32, b16 = copy.deepcopy(template), copy.deepcopy(template)
    f32.bf16_encoder = False
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert b16.uses_bf16_encoder(x) and not f32.uses_bf16_encoder(x)
    loss32, pre32, grads32 = run(f32, x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss16, pre16, grads16 = run(b16, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    threshold, bandwidth = f32.threshold.detach(), f32.bandwidth
    ambiguity = float_ambiguity(x - f32.b_pre.detach(), f32.W_enc.detach(), f32.b_enc.detach())
    distance = (pre32 - threshold).abs()
    clear = (distance > ambiguity) & ((distance - bandwidth / 2).abs() > ambiguity)
    fire32, fire16 = pre32 > threshold, pre16 > threshold
    window32 = ((pre32 - threshold) / bandwidth).abs() < 0.5
    window16 = ((pre16 - threshold) / bandwidth).abs() < 0.5
    differ, ambiguous = int((fire16 != fire32).sum()), int((~clear).sum())
    print(f"firing entries differing: {differ} (of {int(fire32.sum())}); within float32's rounding: {ambiguous}")
    assert torch.equal(fire16[clear], fire32[clear]) and torch.equal(window16[clear], window32[clear])
    assert differ <= ambiguous
    torch.testing.assert_close(loss16, loss32, rtol=1e-2, atol=0)
    for name, grad in grads32.items():
        error = float((grads16[name] - grad).norm() / grad.norm().clamp_min(1e-30))
        assert error < 2e-2, (name, error)
    # the cost: the float32 encoder's step against the bf16 one's (the figure belongs in BENCHMARKS.md)
    times = {}
    for name, sae in (("float32", f32), ("bf16", b16)):
        for _ in range(3):
            run(sae, x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            run(sae, x)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - start) / 10
    with torch.no_grad():
        a = x - b16.b_pre
        a16, W16 = a.bfloat16(), b16.W_enc.bfloat16()
        rows, cols = jb.bound_terms(a, a16, b16.W_enc, W16, b16.b_enc)
        p = jb._mm32(a16, W16) + b16.b_enc
        band = int(jb.band_mask(p, threshold, bandwidth / 2, rows, cols).sum())
    print(f"step (forward, loss, backward): {times}; band {band / BATCH:.1f} entries per token")
    assert times["bf16"] < times["float32"], times
