"""Benchmark: SAE training throughput and ViT-B/14 extraction at paper scale on a GPU.

    python -m benchmarks.gpu                 # CUDA: d_in 768, d_sae 19200, k 32, B 4096, bf16 autocast
    python -m benchmarks.gpu --dry-run       # CPU, tiny shapes, float32 (tests/test_benchmarks_peers.py)

SAE: for every variant, ``--steps`` full training steps (forward, loss, backward, parallel
gradient removal, fused Adam, unit-norm atoms, dead-latent clock, and the SAE's host-side hooks: TopK's
AuxK plan, benchmarks/fit_hooks.py) as ``SAEModule`` runs them, timed between two device syncs after
``--warmup`` steps; tokens/s = B · steps / time. No latent is dead during the timing (the clock starts
at 0), so the TopK family's plan queues no AuxK work, as in a fit while no latent is dead
(benchmarks/peers.py times AuxK with dead latents). ReLU and JumpReLU start with L0 ≈ k (b_enc or θ
set from the batch), the regime of a trained SAE.

Fraction of the FLOP roofline (shallow variants), stated as a formula:

    useful FLOPs per step = 2·B·d_in·d_sae            (encoder GEMM: chooses the latents)
                          + 2·B·k·d_in · 4            (decode, its two gradients, ∂W_enc: sparse)
    roofline fraction     = useful FLOPs / (step time · peak)

``peak`` is the best bf16 throughput of a dense ``[B, d_in] × [d_in, d_sae]`` GEMM measured
here (``measured``), and the vendor's dense bf16 figure where the device name is known
(``datasheet``, from benchmarks/extract.py). A step at fraction 1 would cost exactly one
encoder GEMM: the minimum for any SAE that scores every latent. MP-SAE has no encoder (k
correlation steps instead): its row gives tokens/s only.

Extraction: ``dinov2`` (ViT-B/14 with registers, random weights: same FLOPs), forward under
inference mode and bf16 autocast on a batch of ``--vit-batch`` images, timed like the SAE;
images/s of the forward (benchmarks/extract.py measures the whole command around it).
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch

from benchmarks.extract import peak_tflops
from benchmarks.fit_hooks import FitHooks
from feature_extraction.backbones import load_backbone
from sae_pipeline.sae import SAE_REGISTRY, JumpReLUSAE, ReLUSAE, SparseAutoencoder
from sae_pipeline.training.optim import adam_implementation, param_groups

SHALLOW = tuple(key for key, cls in SAE_REGISTRY.items() if not cls.is_pursuit)  # one encoder GEMM: roofline


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, n: int, device: torch.device) -> float:  # noqa: ANN001
    """Seconds per call over ``n`` calls between two syncs."""
    sync(device)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - start) / n


def make_sae(variant: str, args: argparse.Namespace, x: torch.Tensor) -> SparseAutoencoder:
    torch.manual_seed(0)
    cls = SAE_REGISTRY[variant]
    sae = cls(args.d_in, args.d_sae, k=args.k) if cls.sparsity_knob == "k" else cls(args.d_in, args.d_sae)
    sae = sae.to(x.device)
    sae.init_b_pre(x.mean(0))
    with torch.no_grad():
        if isinstance(sae, (ReLUSAE, JumpReLUSAE)):
            top = sae.pre_activations(x).flatten().topk(x.shape[0] * args.k + 1).values
            cut = (top[-1] + top[-2]) / 2  # B·k entries above it, none at it
            if isinstance(sae, ReLUSAE):
                sae.b_enc.sub_(cut)
            else:
                sae.log_threshold.fill_(float(cut.clamp_min(1e-6).log()))
    return sae.train()


def training_step(sae: SparseAutoencoder, x: torch.Tensor, autocast: bool) -> tuple[Callable[[], None], FitHooks]:
    """One full training step of ``sae`` on ``x`` as ``SAEModule`` runs it (its Adam groups, its host-side hooks:
    TopK's AuxK plan, benchmarks/fit_hooks.py), as a function; and the hooks, which count the steps."""
    optimizer = torch.optim.Adam(param_groups(sae, 5e-4), **adam_implementation(sae))
    hooks = FitHooks(sae)

    def step() -> None:
        with hooks.step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
                output = sae(x)
                loss = sae.loss(x, output).loss
            loss.backward()
            sae.record_firing(output.fired(), x.shape[0])
            sae.remove_parallel_grad()
            optimizer.step()
            sae.normalize_atoms()

    return step, hooks


def sae_step_seconds(variant: str, args: argparse.Namespace, x: torch.Tensor, autocast: bool) -> float:
    step, _ = training_step(make_sae(variant, args, x), x, autocast)
    timed(step, args.warmup, x.device)
    return timed(step, args.steps, x.device)


def gemm_peak_flops(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(args.batch_size, args.d_in, device=device, dtype=dtype)
    b = torch.randn(args.d_in, args.d_sae, device=device, dtype=dtype)
    timed(lambda: a @ b, args.warmup, device)
    return 2 * args.batch_size * args.d_in * args.d_sae / timed(lambda: a @ b, args.steps, device)


def vit_images_per_second(args: argparse.Namespace, device: torch.device, autocast: bool) -> tuple[str, float]:
    backbone = load_backbone(args.backbone).to(device).eval()
    size = backbone.spec.image_size
    pixels = torch.randn(args.vit_batch, 3, size, size, device=device)

    def forward() -> None:
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            backbone(pixels)

    timed(forward, args.warmup, device)
    return f"{args.backbone} ({backbone.n_tokens} tokens)", args.vit_batch / timed(forward, args.steps, device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-in", type=int, default=768)
    parser.add_argument("--d-sae", type=int, default=19200)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--variants", nargs="+", default=list(SAE_REGISTRY), choices=list(SAE_REGISTRY))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backbone", default="dinov2", help="extraction backbone (default: dinov2, ViT-B/14)")
    parser.add_argument("--vit-batch", type=int, default=256)
    parser.add_argument("--peak-tflops", type=float, default=None, help="datasheet dense bf16 peak, if not known")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, float32: checks the script runs")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.d_in, args.d_sae, args.k, args.batch_size = 32, 256, 4, 64
        args.steps, args.warmup, args.backbone, args.vit_batch = 2, 1, "vit_tiny", 4
    elif not torch.cuda.is_available():
        parser.error("no CUDA device is visible: run on a GPU machine, or use --dry-run for the CPU check")
    for name in ("d_in", "d_sae", "k", "batch_size", "steps", "vit_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.k > args.d_sae:
        parser.error(f"--k must be in [1, --d-sae={args.d_sae}], got {args.k}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    device = torch.device("cpu" if args.dry_run else "cuda")
    autocast = device.type == "cuda"
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU dry run ({torch.get_num_threads()} threads)"
    )
    dtype = torch.bfloat16 if autocast else torch.float32
    measured_peak = gemm_peak_flops(args, device, dtype)
    datasheet = peak_tflops(device, args.peak_tflops) if device.type == "cuda" else None
    print(
        f"device: {name}; d_in={args.d_in} d_sae={args.d_sae} k={args.k} B={args.batch_size} "
        f"{'bf16 autocast' if autocast else 'float32'}; {args.steps} steps after {args.warmup}"
    )
    print(
        f"dense encoder GEMM: {measured_peak / 1e12:.3g} TFLOP/s measured"
        + (f", datasheet {datasheet:g} TFLOP/s" if datasheet else "")
    )
    print("| variant | step | tokens/s | roofline (measured peak) | roofline (datasheet) |")
    print("|---|---|---|---|---|")
    x = torch.randn(args.batch_size, args.d_in, device=device) + torch.randn(args.d_in, device=device)
    for variant in args.variants:
        seconds = sae_step_seconds(variant, args, x, autocast)
        tokens = args.batch_size / seconds
        if variant in SHALLOW:
            flops = 2 * args.batch_size * args.d_in * args.d_sae + 8 * args.batch_size * args.k * args.d_in
            measured = f"{flops / seconds / measured_peak:.2f}"
            sheet = f"{flops / seconds / (datasheet * 1e12):.2f}" if datasheet else "—"
        else:
            measured = sheet = "—"
        print(f"| {variant} | {seconds * 1e3:.2f} ms | {tokens:,.0f} | {measured} | {sheet} |", flush=True)
    label, images = vit_images_per_second(args, device, autocast)
    print(f"extraction forward, {label}, batch {args.vit_batch}: {images:,.1f} images/s")


if __name__ == "__main__":
    main()
