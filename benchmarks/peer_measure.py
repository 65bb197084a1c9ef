"""What benchmarks/peers.py measures, apart from the printing: the batch and the starting SAE (``make_template``,
``with_dead_latents``), the step times (``median_step``), the memory (``resident_bytes``, ``peak_step_bytes``)
and the equality with ours (``equality``). What each figure means is in benchmarks/peers.py's docstring
("Timing", "Memory", "Equality").
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from benchmarks.peer_adapters import Contender, Ours
from sae_pipeline.sae import (
    BatchTopKSAE,
    JumpReLUSAE,
    MatchingPursuitSAE,
    MatryoshkaBatchTopKSAE,
    ReLUSAE,
    SparseAutoencoder,
    TopKSAE,
)

EQUAL_TOLERANCE = 1e-4  # float32, relative to the largest value
VARIANTS = ("topk", "batchtopk", "matryoshka", "jumprelu", "relu", "mpsae")
OURS: dict[str, type[SparseAutoencoder]] = {
    "topk": TopKSAE,
    "batchtopk": BatchTopKSAE,
    "matryoshka": MatryoshkaBatchTopKSAE,
    "jumprelu": JumpReLUSAE,
    "relu": ReLUSAE,
    "mpsae": MatchingPursuitSAE,
}


def make_batch(d_in: int, batch_size: int, seed: int = 0) -> torch.Tensor:
    """Token-like activations: low-rank plus noise, with an offset."""
    generator = torch.Generator().manual_seed(seed)
    rank = max(d_in // 4, 1)
    mixing = torch.randn(rank, d_in, generator=generator) / rank**0.5
    latent = torch.randn(batch_size, rank, generator=generator)
    return (
        latent @ mixing
        + 0.1 * torch.randn(batch_size, d_in, generator=generator)
        + torch.randn(d_in, generator=generator)
    )


def make_template(variant: str, d_in: int, d_sae: int, k: int, x: torch.Tensor) -> SparseAutoencoder:
    """Our SAE, b_pre at the batch mean, and (ReLU, JumpReLU) L0 ≈ k on ``x``."""
    torch.manual_seed(0)
    cls = OURS[variant]
    sae = cls(d_in, d_sae, k=k) if cls.sparsity_knob == "k" else cls(d_in, d_sae)
    sae.init_b_pre(x.mean(0))
    if isinstance(sae, MatchingPursuitSAE):
        return sae
    with torch.no_grad():
        pre = sae.pre_activations(x)
        # About B·k entries above the cut, none near it: the cut in the widest gap between sorted pre-activations
        # within 1 % of position B·k. At B·d_sae in the millions the two values either side of position B·k can be
        # an ulp apart, and a peer's GEMM (another summation order) then puts a value on the other side of θ.
        want, window = x.shape[0] * k, max(x.shape[0] * k // 100, 1)
        top = pre.flatten().topk(want + window + 1).values
        gaps = top[want - window - 1 : -1] - top[want - window :]
        at = want - window - 1 + int(gaps.argmax())
        cut = (top[at] + top[at + 1]) / 2
        if isinstance(sae, ReLUSAE):
            sae.b_enc.sub_(cut)
        elif isinstance(sae, JumpReLUSAE):
            sae.log_threshold.fill_(float(cut.clamp_min(1e-6).log()))
    return sae


def with_dead_latents(template: SparseAutoencoder, x: torch.Tensor, fraction: float) -> SparseAutoencoder:
    """A copy of ``template`` (of the TopK family) with ``fraction`` of its latents dead, spread evenly over the
    dictionary: their clock at ``dead_after_tokens`` (every contender's bookkeeping starts from it) and their
    encoder bias lowered below every other pre-activation of ``x``, so that none of them fires during the timing
    and the dead set holds (AuxK's work does not depend on their values)."""
    dead_template = copy.deepcopy(template)
    n_dead = min(max(round(fraction * template.d_sae), 1), template.d_sae - template.k)
    dead = torch.zeros(template.d_sae, dtype=torch.bool, device=template.W_dec.device)
    dead[torch.linspace(0, template.d_sae - 1, n_dead, device=dead.device).round().long()] = True
    with torch.no_grad():
        pre = dead_template.pre_activations(x)
        dead_template.b_enc[dead] -= pre.max() - pre.min() + 1
        dead_template.tokens_since_fired[dead] = dead_template.dead_after_tokens
    return dead_template


def median_step(fn: Callable[[], None], n: int, device: torch.device) -> list[float]:
    """``n`` step times; on CUDA ``n`` copies of their mean between two syncs (the queue stays full)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize(device)
        return [(time.perf_counter() - start) / n] * n
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def resident_bytes(contender: Contender) -> int:
    """Parameters, their gradients, buffers, the optimiser state (each storage once) and kept scratch."""
    seen: dict[int, int] = {}
    tensors = list(contender.model.parameters()) + list(contender.model.buffers())
    tensors += [p.grad for p in contender.model.parameters() if p.grad is not None]
    for state in contender.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) + contender.kept_bytes()


def peak_step_bytes(contender: Contender, x: torch.Tensor) -> int:
    """What is allocated when a step starts, plus the peak of that step's own allocations.

    CPU: two steps under ``torch.profiler`` (allocator events); the second is measured, so every
    block it frees (the first step's gradients, a dictionary a peer replaces in its forward)
    was allocated while recording and its release is seen.
    """
    if x.device.type == "cuda":
        contender.step(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        at_start = resident_bytes(contender)
        contender.step(x)
        torch.cuda.synchronize()
        return at_start + torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        contender.step(x)
        at_start = resident_bytes(contender)
        with record_function("measured_step"):
            contender.step(x)
    events = list(prof.profiler.kineto_results.events())
    window = next(e for e in events if e.name() == "measured_step")
    start, end = window.start_ns(), window.start_ns() + window.duration_ns()
    live = peak = base = 0
    for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if event.start_ns() > end:
            break
        live += event.nbytes()
        if event.start_ns() < start:
            base = live
        else:
            peak = max(peak, live - base)
    return at_start + peak


def relative_difference(ours: Contender, peer: Contender, x: torch.Tensor) -> float:
    """Largest |ours − peer| / largest |ours| over codes, x_hat and the common gradients."""
    with torch.no_grad():
        pairs = list(zip(ours.forward(x), peer.forward(x)))
    ours_grads, peer_grads = ours.grads(x), peer.grads(x)
    pairs += [(ours_grads[name], grad) for name, grad in peer_grads.items()]
    return max(float((a - b).abs().max() / a.abs().max().clamp_min(1e-30)) for a, b in pairs)


def nonpositive_steps(template: MatchingPursuitSAE, x: torch.Tensor) -> int:
    """Pursuit steps (token, t) of ours whose selected correlation is ≤ 0 (where SAELens's clipped MP differs)."""
    with torch.no_grad():
        _, coefficients = template.pursuit(x)
    return int((coefficients <= 0).sum())


def equality(variant: str, peer_cls: type[Contender], template: SparseAutoencoder, x: torch.Tensor, args) -> str:
    template = copy.deepcopy(template)
    if not peer_cls.has_pre_bias(variant):
        with torch.no_grad():
            template.b_pre.zero_()
    if isinstance(template, MatchingPursuitSAE):
        # float64: in float32 a near-tie of two correlations (late steps, small residuals) may
        # resolve differently between any two implementations, which changes that token's codes.
        template, x = template.double(), x.double()
        template.normalize_atoms()  # unit norm in float64 too (overcomplete renormalises in its forward)
    if isinstance(template, MatchingPursuitSAE) and peer_cls.library == "SAELens":
        clipped = nonpositive_steps(template, x)
        if clipped:
            return f"not comparable ({clipped} of {x.shape[0] * args.k} steps ≤ 0)"
    rows = x.shape[0]  # --equal-rows: overcomplete's BatchTopK keeps k·rows codes of the batch it is built for
    diff = relative_difference(Ours(variant, template, rows, args.k), peer_cls(variant, template, rows, args.k), x)
    return f"{'equal' if diff <= EQUAL_TOLERANCE else 'DIFFERS'} ({diff:.1e})"
