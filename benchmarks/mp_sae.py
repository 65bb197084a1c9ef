"""Benchmark: one MP-SAE training step (forward + backward of the MSE) against the plain loop.

    python -m benchmarks.mp_sae                  # CPU: d_in=256, d_sae=4096; B=1024,k=16 and B=4096,k=32
    python -m benchmarks.mp_sae --device cuda    # also d_in=768, d_sae=19200, B=4096, k=32 in fp32 and bf16
    python -m benchmarks.mp_sae --device cuda --autocast   # the same under bf16 autocast (as training runs)
    python -m benchmarks.mp_sae --quick          # tiny shapes, used by tests/test_mp_sae.py (also --dry-run)

The reference is autograd through the loop of docs/design.md ("Definitions"; a dense correlation matmul and a
dense one-hot matmul per step). Both run on the same dictionary and batch in the same run;
times are medians over ``--reps`` after ``--warmup`` untimed steps. "Saved" is what the
autograd graph keeps for backward, summed over ``saved_tensors_hooks`` packs (numel ×
element size, each storage counted once). Targets at d_in=256, d_sae=4096 on CPU:
≥10× faster and ≤1/20 of the saved bytes at B=1024, k=16; ≥20× faster at B=4096, k=32.
The script also reports the fraction of tokens whose selected atoms differ (float32
near-ties can resolve differently; float64 agreement is what the tests check). On CUDA the MP-SAE
step runs the fused Triton pursuit step (sae_pipeline/sae/triton_pursuit.py); a line after each row
gives the same step with ``fused = False`` (the PyTorch ops), measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from sae_pipeline.sae.mp import MatchingPursuitSAE


def plain_loop(x: Tensor, W_dec: Tensor, b_pre: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The reference MP of docs/design.md, differentiated by autograd: (indices, codes, x_hat)."""
    r = x - b_pre
    codes = torch.zeros(x.shape[0], W_dec.shape[0], dtype=x.dtype, device=x.device)
    chosen = []
    for _ in range(k):
        c = r @ W_dec.T
        j = c.argmax(dim=-1)
        onehot = F.one_hot(j, W_dec.shape[0]).to(x.dtype) * c.gather(1, j[:, None])
        codes = codes + onehot
        r = r - onehot @ W_dec
        chosen.append(j)
    return torch.stack(chosen, dim=1), codes, codes @ W_dec + b_pre


def saved_bytes(step: Callable[[], Tensor]) -> int:
    """Bytes the autograd graph of ``step()`` keeps for backward (each storage once)."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        nbytes = t.numel() * t.element_size()
        seen[(t.data_ptr(), nbytes)] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    del loss
    return sum(seen.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], None], device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextlib.contextmanager
def maybe_autocast(args: argparse.Namespace, device: torch.device) -> Iterator[None]:
    """bf16 autocast around a step when ``--autocast`` (CUDA only)."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bool(args.autocast) and device.type == "cuda"):
        yield


def bench_shape(
    d_in: int, d_sae: int, batch_size: int, k: int, dtype: torch.dtype, device: torch.device, args: argparse.Namespace
) -> dict[str, float]:
    torch.manual_seed(0)
    sae = MatchingPursuitSAE(d_in, d_sae, k).to(device=device, dtype=dtype)
    x = torch.randn(batch_size, d_in, device=device, dtype=dtype)
    with torch.no_grad():
        sae.init_b_pre(x.mean(0))
    W_ref = sae.W_dec.detach().clone().requires_grad_()
    b_ref = sae.b_pre.detach().clone().requires_grad_()

    def fast_loss() -> Tensor:
        with maybe_autocast(args, device):
            return F.mse_loss(sae(x).x_hat, x)

    def plain_loss() -> Tensor:
        with maybe_autocast(args, device):
            return F.mse_loss(plain_loop(x, W_ref, b_ref, k)[2], x)

    def fast_step() -> None:
        sae.zero_grad(set_to_none=True)
        fast_loss().backward()

    def plain_step() -> None:
        W_ref.grad = b_ref.grad = None
        plain_loss().backward()

    mismatch = plain_s = plain_b = float("nan")
    if not args.skip_reference:
        with torch.no_grad(), maybe_autocast(args, device):
            fast_indices, _ = sae.pursuit(x)
            plain_indices = plain_loop(x, W_ref, b_ref, k)[0]
        mismatch = (fast_indices != plain_indices).any(dim=1).float().mean().item()

    fast_s = median_seconds(fast_step, device, args.warmup, args.reps)
    if not args.skip_reference:
        plain_s = median_seconds(plain_step, device, args.warmup, args.plain_reps or args.reps)
        plain_b = saved_bytes(plain_loss)
    unfused_s = float("nan")
    if device.type == "cuda":
        sae.fused = False
        unfused_s = median_seconds(fast_step, device, args.warmup, args.reps)
        sae.fused = None
    fast_b = saved_bytes(fast_loss)
    return {
        "fast_s": fast_s,
        "unfused_s": unfused_s,
        "plain_s": plain_s,
        "speedup": plain_s / fast_s,
        "fast_saved_mib": fast_b / 2**20,
        "plain_saved_mib": plain_b / 2**20,
        "memory_ratio": fast_b / plain_b,
        "fast_tokens_per_s": batch_size / fast_s,
        "plain_tokens_per_s": batch_size / plain_s,
        "tokens_with_other_atoms": mismatch,
    }


def parse_shape(text: str) -> tuple[int, int]:
    """``"1024:16"`` -> (batch_size, k)."""
    try:
        batch_size, k = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes takes BATCH:K pairs such as 1024:16, got {text!r}") from None
    return batch_size, k


def pursuit_args(
    argv: list[str] | None, description: str | None, reference: str, reference_help: str
) -> tuple[argparse.Namespace, torch.device]:
    """The flags every pursuit benchmark shares (this one and ``omp_sae.py``); ``--<reference>_reps`` sets
    how often the slow reference side runs. Sets the torch threads."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d_in", type=int, default=256)
    parser.add_argument("--d_sae", type=int, default=4096)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[(1024, 16), (4096, 32)], help="BATCH:K pairs")
    parser.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on CPU")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        f"--{reference}_reps", type=int, default=3, help=f"reps of the (slow) {reference_help}; 0 = --reps"
    )
    parser.add_argument("--quick", "--dry-run", action="store_true", help="tiny shapes, one rep (smoke test)")
    parser.add_argument(
        "--skip_reference", action="store_true", help=f"do not run the {reference_help} (its columns print nan)"
    )
    parser.add_argument("--autocast", action="store_true", help="steps under bf16 autocast (CUDA; as training runs)")
    args = parser.parse_args(argv)
    if args.quick:
        args.d_in, args.d_sae, args.shapes, args.warmup, args.reps = 16, 128, [(64, 4)], 0, 1
        setattr(args, f"{reference}_reps", 1)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda given but torch.cuda.is_available() is False; use --device cpu")
    torch.set_num_threads(args.threads)
    return args, device


def main(argv: list[str] | None = None) -> None:
    args, device = pursuit_args(argv, __doc__, "plain", "plain loop")

    rows = [(args.d_in, args.d_sae, b, k, getattr(torch, args.dtype)) for b, k in args.shapes]
    if device.type == "cuda" and not args.quick:
        rows += [(768, 19200, 4096, 32, torch.float32), (768, 19200, 4096, 32, torch.bfloat16)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device={device} ({name}) threads={torch.get_num_threads()} torch={torch.__version__} autocast={args.autocast}"
    )
    header = (
        f"{'d_in':>5} {'d_sae':>6} {'B':>5} {'k':>3} {'dtype':>8} | {'mp s':>8} {'plain s':>8} {'speedup':>8} | "
        f"{'mp MiB':>8} {'plain MiB':>9} {'mem ratio':>9} | {'mp tok/s':>10} {'plain tok/s':>11} | other atoms"
    )
    print(header)
    for d_in, d_sae, batch_size, k, dtype in rows:
        r = bench_shape(d_in, d_sae, batch_size, k, dtype, device, args)
        print(
            f"{d_in:>5} {d_sae:>6} {batch_size:>5} {k:>3} {str(dtype).split('.')[-1]:>8} | "
            f"{r['fast_s']:>8.4f} {r['plain_s']:>8.4f} {r['speedup']:>7.1f}x | "
            f"{r['fast_saved_mib']:>8.2f} {r['plain_saved_mib']:>9.2f} {r['memory_ratio']:>9.4f} | "
            f"{r['fast_tokens_per_s']:>10.0f} {r['plain_tokens_per_s']:>11.0f} | {r['tokens_with_other_atoms']:.4f}",
            flush=True,
        )
        if device.type == "cuda":
            print(
                f"      fused=False (PyTorch ops): {r['unfused_s']:.4f} s; "
                f"fused step {r['unfused_s'] / r['fast_s']:.2f}x faster",
                flush=True,
            )


if __name__ == "__main__":
    main()
