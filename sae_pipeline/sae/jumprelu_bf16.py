"""JumpReLU's encoder GEMM in bf16, its threshold decisions those of the float32 encoder.

Why: JumpReLU reads two decisions off each pre-activation ``pre``: whether the latent fires
(``pre > θ``) and whether the entry carries θ's straight-through gradient (``|pre − θ| < ε/2``, the
rectangle kernel). A bf16 GEMM moves ``pre`` by up to ~u·Σ|a_k w_k| (u = 2⁻⁸, bf16's unit roundoff;
about u·‖a‖·‖w‖, ~0.1 for inputs normalised to E‖x‖² = d_in = 768 and unit encoder columns), more than
ε/2 = 0.025 and far more than the distance to θ of the entries that decide the firing set, so a bf16
encoder changes which latents fire and which entries train θ. So the encoder ran in float32 under
autocast too, which on an H200 is a SIMT SGEMM (no float32 tensor cores) slower than the rest of the
step (issue 41, item 5).

What: under bf16 autocast the GEMM runs on bf16 operands with float32 accumulation and output
(tensor cores), and only the entries that the rounding could have carried across one of the three cuts
θ − ε/2, θ, θ + ε/2 are recomputed in float32: the *band* ``|p − θ| ≤ ε/2 + δ``, where ``δ`` bounds
``|p − p₃₂|``, p our value and p₃₂ the float32 encoder's. An entry outside the band lies on the same
side of every cut as p₃₂ does, so the firing set and the kernel window are the float32 encoder's;
an entry inside it gets the float32 value, so its decisions are float32's too (up to float32's own
rounding, which already differs between two float32 GEMMs by ~1e-7 relative).

The bound, per entry (a = x − b_pre in float32, w = W_enc[:, j], b = b_enc[j]; ã, w̃ their bf16
roundings; d = d_in; u₃₂ = 2⁻²⁴; γ = (d + 1)·u₃₂ / (1 − (d + 1)·u₃₂)):

    |p − p₃₂| ≤ ‖a − ã‖·‖w‖ + ‖ã‖·‖w − w̃‖    the bf16 rounding of the operands (Cauchy–Schwarz on
                                              Σ a w − Σ ã w̃ = Σ (a − ã) w + Σ ã (w − w̃))
              + 2γ·‖ã‖·‖w̃‖                  the GEMM's float32 accumulation (twice the rounding
                                              bound: tensor cores may truncate instead of round)
              + u₃₂·|p|                      the float32 bias add
              + γ·(‖a‖·‖w‖ + |b|)            the float32 encoder's own rounding
              = δ

``‖a − ã‖ ≤ u·‖a‖`` (about 0.6·u·‖a‖ for typical data), so δ is about u·‖a‖·‖w‖ and the band holds the
entries within ~u·‖a‖·‖w‖ + ε/2 of θ: at a trained θ about as many as fire. The actual errors stay well
inside δ (a bound, not an estimate: under a fifth of it in `tests/test_jumprelu_bf16.py`). The band test
uses ``SAFETY · δ`` plus ``4u₃₂·(|θ| + ε/2)`` (the float32 rounding of the norms, products and comparisons
themselves: a band too narrow would change the firing set, one too wide only costs time). With a
token-scaled threshold θ and ε are ``θ·s(x)`` and ``ε·s(x)``, as ``JumpReLUSAE.gate`` compares them.

Where the float32 values come from (:func:`bf16_pre_activations`): on a GPU one Triton kernel
(`_band_kernel`) reads the GEMM's output tile by tile, adds ``b_enc``, finds the band and recomputes
its entries in place, each as a float32 dot product; a tile with more than ``MAX_LOOP`` band entries (θ
in the bulk of the pre-activations: an uncalibrated θ early in training) is recomputed whole with a
float32 ``tl.dot``. No buffer of band entries, so nothing can overflow, and no size goes to the host:
the step stays sync-free and capturable. The CPU (``JumpReLUSAE.bf16_encoder = True``, for the tests)
computes the same with torch: ``torch.where(band, the float32 encoder, p)``, which costs a float32 GEMM
more and is not used by default there.

The codes beyond the band keep the bf16 GEMM's values (error ≤ δ, as every other variant's codes under
autocast): the decoder's GEMM rounds the codes to bf16 anyway, so a float32 value there would buy
nothing. The gradients are the float32 encoder's, through bf16 GEMMs (autocast's precision for every
other matmul): ``pre`` is linear in ``a, W_enc, b_enc`` whichever precision computed its value, so the
recomputed entries pass their gradient straight through (:class:`Bf16Encoder`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs none of this
    triton = None

F32_UNIT = 2.0**-24  # float32's unit roundoff
SAFETY = 1.25  # δ's multiplier in the band test (see the module docstring)
COMPARE_UNITS = 4.0  # float32 roundoffs of |θ| + ε/2 added for the comparisons themselves
#: Band entries a kernel tile recomputes one by one; a tile with more is recomputed whole (float32 tl.dot).
MAX_LOOP = 16
#: ``(rows, latents)`` of a kernel tile, the columns of its dense float32 ``tl.dot`` and of an entry's dot product.
TILE = (16, 64)
DOT_BLOCK_K = 32
ENTRY_BLOCK_K = 256
#: False once the kernel (or the bf16 GEMM with float32 output) failed on this machine (said once): the float32
#: encoder from then on.
use_triton = True


def kernel_available() -> bool:
    """Whether the band kernel may run on CUDA tensors: Triton imported and not failed here."""
    return triton is not None and use_triton


def _mm32(x16: Tensor, y16: Tensor) -> Tensor:
    """``x16 @ y16`` of bf16 operands, accumulated and returned in float32: cuBLAS's bf16 GEMM with float32
    output on CUDA (no rounding of the output to bf16, no split-K reduction in bf16); on the CPU, or where
    that GEMM is missing, the float32 GEMM of the rounded operands (the same arithmetic: the product of two
    bf16 numbers is exact in float32)."""
    if x16.is_cuda and use_triton:
        try:
            return torch.mm(x16, y16, out_dtype=torch.float32)
        except (RuntimeError, TypeError) as exn:  # a torch without mm's out_dtype: the float32 encoder from now on
            _give_up("bf16 GEMM with float32 output", exn)
    return torch.mm(x16.float(), y16.float())


def _give_up(what: str, exn: Exception) -> None:
    """Say once that ``what`` failed here; later steps use the float32 encoder (`kernel_available`)."""
    global use_triton
    use_triton = False
    reason = f"{type(exn).__name__}: {str(exn).splitlines()[0] if str(exn) else ''}"
    warnings.warn(
        f"JumpReLU's bf16 encoder: the {what} failed on this device ({reason}); its encoder runs in float32 for "
        "the rest of the run (same firing sets, slower)",
        RuntimeWarning,
        stacklevel=4,
    )


def bound_terms(a: Tensor, a16: Tensor, W_enc: Tensor, W16: Tensor, b_enc: Tensor) -> tuple[Tensor, Tensor]:
    """``rows [B, 2]`` and ``cols [3, d_sae]`` such that ``SAFETY · δ_ij = rows[i, 0]·cols[0, j] + rows[i, 1]·cols[1, j]
    + cols[2, j] + SAFETY·u₃₂·|p_ij|`` (the module docstring's δ), all float32."""
    d = a.shape[1]
    gamma = (d + 1) * F32_UNIT / (1 - (d + 1) * F32_UNIT)
    a16f, W16f = a16.float(), W16.float()
    a_norm, a_err, a16_norm = a.norm(dim=1), (a - a16f).norm(dim=1), a16f.norm(dim=1)
    w_norm, w_err, w16_norm = W_enc.norm(dim=0), (W_enc - W16f).norm(dim=0), W16f.norm(dim=0)
    rows = torch.stack([a_err + gamma * a_norm, a16_norm], dim=1).mul_(SAFETY)
    cols = torch.stack([w_norm, w_err + 2 * gamma * w16_norm, gamma * b_enc.abs()]).mul_(SAFETY)
    return rows.contiguous(), cols.contiguous()


def band_mask(pre: Tensor, threshold: Tensor, half: float | Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """Bool ``[B, d_sae]``: the entries of ``pre`` (float32, ``b_enc`` added) within ``half + SAFETY·δ`` of
    ``threshold`` (``[d_sae]`` or ``[B, d_sae]``; ``half`` ε/2, or ``[B, 1]`` with a token-scaled threshold)."""
    slack = torch.addmm(cols[2], rows, cols[:2])
    slack.add_(pre.abs(), alpha=SAFETY * F32_UNIT).add_(threshold.abs() + half, alpha=COMPARE_UNITS * F32_UNIT)
    return (pre - threshold).abs_() <= slack.add_(half)


def fix_band_torch(
    p: Tensor,
    a: Tensor,
    W_enc: Tensor,
    b_enc: Tensor,
    threshold: Tensor,
    half: float | Tensor,
    rows: Tensor,
    cols: Tensor,
) -> Tensor:
    """``p + b_enc`` with the band's entries taken from the float32 encoder (``torch.where``: no host read)."""
    pre = p.add_(b_enc)
    return torch.where(band_mask(pre, threshold, half, rows, cols), torch.addmm(b_enc, a, W_enc), pre)


class Bf16Encoder(torch.autograd.Function):
    """``pre = a @ W_enc + b_enc`` ``[B, d_sae]`` float32: the bf16 GEMM, the band recomputed in float32.

    Backward: the float32 encoder's gradients through bf16 GEMMs with float32 output (the recomputed
    entries straight through: the map is linear, its derivative the same whichever precision computed the
    value). ``threshold`` ``[d_sae]`` (θ, detached), ``scale`` ``[B, 1]`` or None (the token scale
    s(x)), ``half_bandwidth`` ε/2.
    """

    @staticmethod
    def forward(
        ctx: Any,
        a: Tensor,
        W_enc: Tensor,
        b_enc: Tensor,
        threshold: Tensor,
        scale: Tensor | None,
        half_bandwidth: float,
        use_kernel: bool,
    ) -> Tensor:
        with torch.autocast(device_type=a.device.type, enabled=False):
            a, W_det, b_det = a.detach(), W_enc.detach(), b_enc.detach()
            a16, W16 = a.to(torch.bfloat16), W_det.to(torch.bfloat16)
            p = _mm32(a16, W16)
            rows, cols = bound_terms(a, a16, W_det, W16, b_det)
            pre = None
            if use_kernel:
                pre = _kernel_or_none(p, a, W_det, b_det, threshold, scale, half_bandwidth, rows, cols)
            if pre is None:
                theta = threshold if scale is None else threshold * scale
                half = half_bandwidth if scale is None else half_bandwidth * scale
                pre = fix_band_torch(p, a, W_det, b_det, theta, half, rows, cols)
        ctx.save_for_backward(a16, W16)
        return pre

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        a16, W16 = ctx.saved_tensors
        need_a, need_W, need_b = ctx.needs_input_grad[:3]
        grad_a = grad_W = grad_b = None
        with torch.autocast(device_type=grad.device.type, enabled=False):
            grad16 = grad.to(torch.bfloat16)
            if need_a:
                grad_a = _mm32(grad16, W16.T)
            if need_W:  # [d_sae, d_in] transposed: the strides of W_enc = W_dec.T.clone()
                grad_W = _mm32(grad16.T, a16).T
            if need_b:
                grad_b = grad.sum(0)
        return grad_a, grad_W, grad_b, None, None, None, None


def bf16_pre_activations(
    a: Tensor, W_enc: Tensor, b_enc: Tensor, threshold: Tensor, scale: Tensor | None, half_bandwidth: float
) -> Tensor:
    """``a @ W_enc + b_enc`` (``a = x − b_pre``, float32) with float32's threshold decisions; see the module
    docstring. The Triton kernel on CUDA, the torch path elsewhere."""
    use_kernel = a.is_cuda and kernel_available()
    return Bf16Encoder.apply(a, W_enc, b_enc, threshold.detach(), scale, float(half_bandwidth), use_kernel)


def _kernel_or_none(
    p: Tensor,
    a: Tensor,
    W_enc: Tensor,
    b_enc: Tensor,
    threshold: Tensor,
    scale: Tensor | None,
    half_bandwidth: float,
    rows: Tensor,
    cols: Tensor,
) -> Tensor | None:
    """The kernel's result, or None (said once) when it fails to compile or launch here: the caller then
    computes the torch path, and later steps use the float32 encoder (`kernel_available`)."""
    try:
        return fix_band_kernel(p, a, W_enc, b_enc, threshold, scale, half_bandwidth, rows, cols)
    except Exception as exn:  # noqa: BLE001 (any compile or launch failure: the torch path computes the same)
        _give_up("band kernel", exn)
        return None


def fix_band_kernel(
    p: Tensor,
    a: Tensor,
    W_enc: Tensor,
    b_enc: Tensor,
    threshold: Tensor,
    scale: Tensor | None,
    half_bandwidth: float,
    rows: Tensor,
    cols: Tensor,
    *,
    max_loop: int = MAX_LOOP,
    count: Tensor | None = None,
) -> Tensor:
    """``p + b_enc`` in place (``p`` the GEMM's float32 output ``[B, d_sae]``, contiguous rows), the band's
    entries recomputed in float32 (`_band_kernel`). ``max_loop``: band entries a tile recomputes one by one
    (0: every tile with a band entry is recomputed whole); ``count``: an int32 ``[1]`` that the band's size
    is added to (the tests, the benchmark)."""
    batch, d_sae = p.shape
    assert p.stride(1) == 1 and rows.is_contiguous() and cols.is_contiguous()
    block_m, block_n = TILE
    grid = (triton.cdiv(batch, block_m), triton.cdiv(d_sae, block_n))
    token_scale = threshold if scale is None else scale.reshape(-1).contiguous()
    _band_kernel[grid](
        p,
        a,
        W_enc,
        b_enc.contiguous(),
        threshold.contiguous(),
        token_scale,
        rows,
        cols,
        p if count is None else count,
        batch,
        d_sae,
        a.shape[1],
        p.stride(0),
        a.stride(0),
        a.stride(1),
        W_enc.stride(0),
        W_enc.stride(1),
        half_bandwidth,
        SAFETY * F32_UNIT,
        COMPARE_UNITS * F32_UNIT,
        HAS_SCALE=scale is not None,
        HAS_COUNT=count is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_K=DOT_BLOCK_K,
        ENTRY_K=ENTRY_BLOCK_K,
        MAX_LOOP=max_loop,
        num_warps=4,
    )
    return p


if triton is not None:

    @triton.jit
    def _band_kernel(
        p_ptr,
        a_ptr,
        w_ptr,
        bias_ptr,
        theta_ptr,
        scale_ptr,
        rows_ptr,
        cols_ptr,
        count_ptr,
        B,
        N,
        K,
        stride_p,
        stride_a0,
        stride_a1,
        stride_w0,
        stride_w1,
        half_bandwidth,
        out_unit,
        compare_unit,
        HAS_SCALE: tl.constexpr,
        HAS_COUNT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_K: tl.constexpr,
        ENTRY_K: tl.constexpr,
        MAX_LOOP: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < B
        col_ok = cols < N
        ok = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        tile = p_ptr + rows64[:, None] * stride_p + cols[None, :]
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
        pre = tl.load(tile, mask=ok, other=0.0) + bias[None, :]
        theta = tl.load(theta_ptr + cols, mask=col_ok, other=0.0)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + rows, mask=row_ok, other=1.0)
            threshold = theta[None, :] * scale[:, None]
            half = (half_bandwidth * scale)[:, None]
        else:
            threshold = theta[None, :]
            half = half_bandwidth
        r0 = tl.load(rows_ptr + rows64 * 2, mask=row_ok, other=0.0)
        r1 = tl.load(rows_ptr + rows64 * 2 + 1, mask=row_ok, other=0.0)
        c0 = tl.load(cols_ptr + cols, mask=col_ok, other=0.0)
        c1 = tl.load(cols_ptr + N + cols, mask=col_ok, other=0.0)
        c2 = tl.load(cols_ptr + 2 * N + cols, mask=col_ok, other=0.0)
        slack = r0[:, None] * c0[None, :] + r1[:, None] * c1[None, :] + c2[None, :]
        slack += out_unit * tl.abs(pre) + compare_unit * (tl.abs(threshold) + half)
        band = ok & (tl.abs(pre - threshold) <= half + slack)
        n = tl.sum(band.to(tl.int32))
        if n > MAX_LOOP:  # many: the whole tile in float32 (FMA, no TF32)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, K, DOT_K):
                ks = start + tl.arange(0, DOT_K)
                k_ok = ks < K
                a_tile = tl.load(
                    a_ptr + rows64[:, None] * stride_a0 + ks[None, :] * stride_a1,
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                w_tile = tl.load(
                    w_ptr + ks[:, None] * stride_w0 + cols[None, :].to(tl.int64) * stride_w1,
                    mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                acc = tl.dot(a_tile, w_tile, acc=acc, input_precision="ieee")
            pre = tl.where(band, acc + bias[None, :], pre)
        else:  # few: one float32 dot product per band entry
            flat = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            pending = band
            for _ in range(n):
                entry = tl.min(tl.where(pending, flat, BLOCK_M * BLOCK_N))
                row = (pid_m * BLOCK_M + entry // BLOCK_N).to(tl.int64)
                col = (pid_n * BLOCK_N + entry % BLOCK_N).to(tl.int64)
                acc = tl.zeros([ENTRY_K], dtype=tl.float32)
                for start in range(0, K, ENTRY_K):
                    ks = start + tl.arange(0, ENTRY_K)
                    k_ok = ks < K
                    a_row = tl.load(a_ptr + row * stride_a0 + ks * stride_a1, mask=k_ok, other=0.0)
                    w_col = tl.load(w_ptr + ks * stride_w0 + col * stride_w1, mask=k_ok, other=0.0)
                    acc += a_row * w_col
                value = tl.sum(acc) + tl.load(bias_ptr + col)
                pre = tl.where(flat == entry, value, pre)
                pending = pending & (flat != entry)
        tl.store(tile, pre, mask=ok)
        if HAS_COUNT:
            tl.atomic_add(count_ptr, n)
