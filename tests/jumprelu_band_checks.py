"""Shared pieces of the bf16 JumpReLU encoder's tests (`sae_pipeline/sae/jumprelu_bf16.py`): trained-like and
adversarial thresholds, the band kernel against the torch path (on the CPU under the Triton interpreter, run
as ``TRITON_INTERPRET=1 python -m tests.jumprelu_band_checks`` by `tests/test_jumprelu_bf16.py`; on CUDA by
`tests/test_gpu_jumprelu_bf16.py`) and the kernel compiled for a GPU architecture without one."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sae_pipeline.sae import JumpReLUSAE
from sae_pipeline.sae import jumprelu_bf16 as jb
from sae_pipeline.sae.calibration import per_latent_cut


def trained_like(d_in: int, d_sae: int, x: Tensor, k: float, seed: int, **kwargs: object) -> JumpReLUSAE:
    """A JumpReLU SAE as training leaves it: encoder columns of uneven norms, a negative ``b_enc``, θ per
    latent at the cut that ``k/d_sae`` of the batch exceed, spread by ±10 % (L0 ≈ k)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    sae = JumpReLUSAE(
        d_in, d_sae, sparsity_loss="target_l0", target_l0=k, sparsity_coefficient=1.0, initial_threshold=1.0, **kwargs
    )
    sae = sae.to(x.device)
    with torch.no_grad():
        sae.init_b_pre(x.mean(0))
        sae.W_enc.mul_(torch.exp(0.3 * torch.randn(d_sae, generator=g)).to(x.device))
        spread = float(sae.pre_activations(x).std())
        sae.b_enc.copy_(-0.1 * spread * torch.rand(d_sae, generator=g).to(x.device))
        pre = sae.pre_activations(x)
        if sae.token_scaled_threshold:
            pre = pre / sae._token_scale
        cut = per_latent_cut(pre, k) * torch.exp(0.1 * torch.randn(d_sae, generator=g)).to(x.device)
        sae.log_threshold.copy_(cut.clamp_min(1e-3 * float(pre.abs().mean())).log())
    return sae


def bf16_ulp(value: Tensor) -> Tensor:
    """The spacing of bf16 numbers at ``value`` (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(value.abs())) - 7)


def adversarial_thresholds(pre: Tensor, k: float, offset: float, seed: int) -> Tensor:
    """``log θ`` ``[d_sae]`` that puts, for every latent, the entry of rank ``B·k/d_sae`` (so L0 ≈ k) at
    ``m`` bf16 ulps from the cut ``θ − offset`` (``offset`` 0: θ; ∓ε/2: the kernel's edges), m = −4 … 4."""
    batch, d_sae = pre.shape
    rank = max(1, round(batch * k / d_sae))
    values = pre.topk(rank, dim=0).values[-1]  # [d_sae]
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(-4, 5, (d_sae,), generator=g).to(pre.device).float()
    cut = values - steps * bf16_ulp(values)  # values sit `steps` ulps above the cut
    return (cut + offset).clamp_min(1e-6).log()


def float_ambiguity(a: Tensor, W_enc: Tensor, b_enc: Tensor) -> Tensor:
    """``[B, d_sae]``: how far apart two float32 evaluations of ``a @ W_enc + b_enc`` may lie (2γ·(‖a‖‖w‖ + |b|),
    γ = (d_in + 1)·2⁻²⁴), the width within which float32 itself decides a cut either way."""
    gamma = (a.shape[1] + 1) * jb.F32_UNIT / (1 - (a.shape[1] + 1) * jb.F32_UNIT)
    return 2 * gamma * (a.norm(dim=1)[:, None] * W_enc.norm(dim=0)[None, :] + b_enc.abs())


def check_kernel(kernel: object, sae: JumpReLUSAE, x: Tensor, max_loop: int) -> int:
    """The band kernel (``kernel``: `jumprelu_bf16.fix_band_kernel`) against the torch path on ``x``: the float32
    encoder's firing set and kernel window, the torch path's values outside the band bit for bit, the float32
    values in it; returns the band's size."""
    with torch.no_grad():
        a = x - sae.b_pre
        pre32 = torch.addmm(sae.b_enc, a, sae.W_enc)
        a16, W16 = a.bfloat16(), sae.W_enc.bfloat16()
        p = jb._mm32(a16, W16)
        rows, cols = jb.bound_terms(a, a16, sae.W_enc, W16, sae.b_enc)
        scale = sae._token_scale
        theta = sae.threshold
        threshold = theta if scale is None else theta * scale
        half = sae.bandwidth / 2 if scale is None else sae.bandwidth / 2 * scale
        band = jb.band_mask(p + sae.b_enc, threshold, half, rows, cols)
        reference = jb.fix_band_torch(p.clone(), a, sae.W_enc, sae.b_enc, threshold, half, rows, cols)
        count = torch.zeros(1, dtype=torch.int32, device=x.device)
        out = kernel(  # type: ignore[operator]
            p.clone(),
            a,
            sae.W_enc,
            sae.b_enc,
            theta,
            scale,
            sae.bandwidth / 2,
            rows,
            cols,
            max_loop=max_loop,
            count=count,
        )
    bandwidth = sae.bandwidth if scale is None else sae.bandwidth * scale
    # Two float32 dot products of different summation orders (the kernel's, the BLAS GEMM's) differ by up to
    # 2γ(‖a‖‖w‖ + |b|): an entry that close to a cut is decided by float32's rounding itself, either way.
    ambiguity = float_ambiguity(a, sae.W_enc, sae.b_enc)
    distance = (pre32 - threshold).abs()
    clear = (distance > ambiguity) & ((distance - bandwidth / 2).abs() > ambiguity)
    for name, value in (("kernel", out), ("torch", reference)):
        where = clear if name == "kernel" else torch.ones_like(clear)  # the torch path is the BLAS GEMM there
        assert torch.equal((value > threshold)[where], (pre32 > threshold)[where]), name
        window = ((value - threshold) / bandwidth).abs() < 0.5
        assert torch.equal(window[where], (((pre32 - threshold) / bandwidth).abs() < 0.5)[where]), name
    assert torch.isfinite(out).all()
    # Outside the band the torch path's p + b_enc bit for bit; the two band tests may round their slack apart
    # (a fused multiply-add on a GPU), so an entry at the band's very edge may be recomputed by one only.
    edge = (~band) & (out != reference)
    allowance = 2 + int(band.sum()) // 10_000
    edges, size = int(edge.sum()), int(band.sum())
    assert edges <= allowance and abs(int(count) - size) <= allowance, (edges, int(count), size)
    scale_of = float(pre32.abs().max())
    recomputed = band | edge
    torch.testing.assert_close(out[recomputed], pre32[recomputed], rtol=0, atol=1e-5 * scale_of)
    return int(count)


def interpreted_checks(device: str = "cpu", shape: tuple[int, int, int] = (72, 200, 80), k: int = 8) -> list[str]:
    """Both branches of the kernel (one dot product per band entry; the tile's float32 ``tl.dot`` with
    ``max_loop`` 0), with and without a token-scaled threshold, at a trained-like θ and an adversarial one;
    shapes off the tiles' multiples. Also the autograd Function through the kernel against the torch path."""
    d_in, d_sae, batch = shape
    checked = []
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(batch, d_in, generator=g) + torch.randn(d_in, generator=g)).to(device)
    for token_scaled in (False, True):
        sae = trained_like(d_in, d_sae, x, k, 0, token_scaled_threshold=token_scaled)
        with torch.no_grad():
            pre = sae.pre_activations(x)
            adversarial = adversarial_thresholds(pre if not token_scaled else pre / sae._token_scale, k, 0.0, 1)
        for theta in ("trained", "adversarial"):
            if theta == "adversarial":
                with torch.no_grad():
                    sae.log_threshold.copy_(adversarial)
            for max_loop in (jb.MAX_LOOP, 0):
                size = check_kernel(jb.fix_band_kernel, sae, x, max_loop)
                assert size > 0
                checked.append(f"{'scaled' if token_scaled else 'plain'}-{theta}-{max_loop}")
    # the Function end to end: the kernel's forward, the same backward
    sae = trained_like(d_in, d_sae, x, k, 1)
    results = []
    for use_kernel in (True, False):
        sae.zero_grad(set_to_none=True)
        a = x - sae.b_pre
        pre = jb.Bf16Encoder.apply(a, sae.W_enc, sae.b_enc, sae.threshold.detach(), None, sae.bandwidth / 2, use_kernel)
        (pre.square().mean() + pre.mean()).backward()
        results.append((pre.detach(), [p.grad.clone() for p in (sae.W_enc, sae.b_enc, sae.b_pre)]))
    assert jb.kernel_available(), "the kernel failed"
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-5 * float(results[1][0].abs().max()))
    for got, want in zip(results[0][1], results[1][1]):  # the same backward; its bf16 inputs may round apart
        assert float((got - want).norm() / want.norm()) < 1e-3
    return checked


def compile_for(capability: int) -> list[int]:
    """The band kernel compiled to a cubin for ``sm_<capability>`` (no GPU needed), for each of its
    constexpr variants; returns the cubins' sizes."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(jb._band_kernel.fn).parameters)
    ints = {"B", "N", "K", "stride_p", "stride_a0", "stride_a1", "stride_w0", "stride_w1"}
    floats = {"half_bandwidth", "out_unit", "compare_unit"}
    signature = {}
    for name in names:
        if name.endswith("_ptr"):
            signature[name] = "*i32" if name == "count_ptr" else "*fp32"
        else:
            signature[name] = "i32" if name in ints else "fp32" if name in floats else "constexpr"
    sizes = []
    for has_scale in (False, True):
        for has_count in (False, True):
            constants = {
                "HAS_SCALE": has_scale,
                "HAS_COUNT": has_count,
                "BLOCK_M": jb.TILE[0],
                "BLOCK_N": jb.TILE[1],
                "DOT_K": jb.DOT_BLOCK_K,
                "ENTRY_K": jb.ENTRY_BLOCK_K,
                "MAX_LOOP": jb.MAX_LOOP,
            }
            source = ASTSource(
                fn=jb._band_kernel,
                signature=signature,
                constexprs={(names.index(name),): value for name, value in constants.items()},
            )
            compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
            sizes.append(len(compiled.asm["cubin"]))
    return sizes


if __name__ == "__main__":
    torch.manual_seed(0)
    assert math.isfinite(jb.SAFETY)
    print("checked:", " ".join(interpreted_checks()))
