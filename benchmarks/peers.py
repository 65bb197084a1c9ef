"""Benchmark: one shallow-SAE training step, ours against SAELens, overcomplete, sparsify and dictionary_learning.

    pip install -e ".[bench]"                 # the peers (never a runtime dependency)
    python -m benchmarks.peers                # d_in 768, d_sae 8192 and 16384, B 1024, k 32, float32, CPU
    python -m benchmarks.peers --dry-run      # tiny shapes, one round, 1 thread (tests/test_benchmarks_peers.py)
    python -m benchmarks.peers --device cuda --d-sae 19200 --batch-size 4096 --equal-rows 1024 --autocast   # GPU
    python -m benchmarks.peers --device cuda ... --peers SAELens+compile    # SAELens compiled (its compile_sae)

On CUDA (``--device cuda``) everything above holds on the GPU: the same shapes and dtype (float32), the
peers stepping as their own trainers do there (sparsify with its Triton decoder). ``--autocast`` times
every contender's step (and the GEMM) under bf16 autocast, the precision training uses on a GPU and each
peer's fastest setting (sparsify's forward carries that autocast itself, dictionary_learning's ``trainSAE``
and SAELens's runner offer it); the equality check still runs in float32. The peers travel to a lent GPU
machine as wheels (benchmarks/gpu_wheels.sh); benchmarks/gpu_suite.py runs this there.

For each variant (TopK, BatchTopK, Matryoshka BatchTopK, JumpReLU, ReLU, MP-SAE) every library that has it
trains from the same weights (ours, copied in) on the same batch with the same optimiser (Adam, lr 5e-4,
torch's fused implementation for all). A step is what the library's own training loop does: forward, loss,
firing bookkeeping, backward, decoder-norm maintenance, Adam (each library's adapter says what that is:
benchmarks/peer_saelens.py, peer_overcomplete.py, peer_sparsify.py, peer_dictionary_learning.py; the interface
and ours, benchmarks/peer_adapters.py); ours is the step ``SAEModule`` runs,
its host-side hooks included (benchmarks/fit_hooks.py). ReLU and JumpReLU start at the sparsity of a trained
SAE: b_enc (ReLU) or θ (JumpReLU) is set so that B·k codes of the batch are active (L0 ≈ k), the regime the
paper compares them in; at init they would fire on half the latents. MP-SAE has no encoder: its k pursuit
steps are the sparsity (SAELens ``matching_pursuit``, overcomplete ``MpSAE``). No peer has our OMP-SAE
(overcomplete's ``OMPSAE`` solves a non-negative least squares by 10 projected-gradient steps, without
gradients through the codes: another function), so it has no row.

AuxK, like for like: the TopK family (TopK, BatchTopK, Matryoshka) is timed twice. First with no dead latent
("dead" 0.0 %): every AuxK is then idle (ours queues none: on a GPU its plan knows the dead count is 0, on the
CPU it reads it; SAELens, sparsify and dictionary_learning read their dead count and skip theirs), the
step that overcomplete's, which has no AuxK ("no AuxK"), is to be compared with. Then with ``--dead-fraction``
of the latents dead (default 1/16, spread over the dictionary): their encoder bias is lowered below every
other pre-activation of the batch, so that none of them fires during the timing, and every library's own
firing bookkeeping starts with them dead, so that each AuxK runs on every step: ours beside SAELens's,
sparsify's and dictionary_learning's. The "dead" column is what each contender's own bookkeeping counts
dead at the end of the timing ("a → b" where it changed during the timing; "—" for a variant without AuxK).

Timing: contenders are interleaved: each round times a dense encoder GEMM
(``(x − b_pre) @ W_enc``, ``[B, d_in] × [d_in, d_sae]``, fresh output; MP-SAE: ``W_decᵀ``, its
first correlations) and then ``--steps``
steps of every contender; the figure is the median over all rounds (on a shared machine a
burst of interference spoils single steps, which the median ignores). On CUDA a round's
``--steps`` steps run between two device syncs (a sync per step would stall the queue and time
the launch latency instead) and each counts as their mean. "÷ GEMM" is the step
over the GEMM's median from the same rounds; "÷ ours" the contender's step over ours. ``--warmup``
untimed steps come first (at least 3 for a compiled step: it compiles in them, so its figures are after
compilation). The last table gives, per variant and dead fraction, the fastest peer's step and peak memory
over ours (> 1: ours is faster, or leaner).

Memory: "resident" is what a contender holds between steps: parameters, gradients, buffers,
Adam state, and scratch it keeps for the next step (our MP-SAE's workspace); "peak memory" is
that plus the peak of what one step allocates on top (torch's allocator events through
``torch.profiler``; CUDA: ``max_memory_allocated``).

Equality: where the definitions coincide the codes, ``x_hat`` and the gradients of
``mean((x_hat − x)²)`` (``W_dec``'s with its parallel component removed; SAELens TopK rescales
codes by the decoder norms, which changes only that component) are compared with ours from the
same weights; the table gives the largest difference relative to the largest value.
overcomplete has no pre-bias ``b_pre``, nor does dictionary_learning's JumpReLU encoder, so they are
compared with ``b_pre = 0``; thresholds are
not compared (SAELens and dictionary_learning train θ, we and overcomplete log θ). MP-SAE: SAELens's
``matching_pursuit`` clips each step's correlation at zero, ours and overcomplete's take the
signed argmax; they coincide when every selected correlation is positive, which is checked on
the batch first ("not comparable" otherwise). MP-SAE is compared in float64 (weights and batch
converted): in float32 a near-tie between two correlations at a late step may resolve
differently in two implementations (overcomplete's dense correlations against our Gram-row
updates picked two atoms in the other order on 1 of 1024 tokens at d_sae 8192, 2e-3 relative).
``--equal-rows N`` checks equality on the batch's first N rows (default: all): at B 4096 and
d_sae 19200 overcomplete's float64 pursuit keeps k dense ``[B, d_sae]`` tensors under autograd,
more than an 80 GB GPU holds.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import warnings

import torch

from benchmarks.peer_adapters import AUXK_VARIANTS, Contender, Ours
from benchmarks.peer_dictionary_learning import VARIANTS as DICTIONARY_LEARNING_VARIANTS
from benchmarks.peer_dictionary_learning import DictionaryLearning
from benchmarks.peer_measure import (
    VARIANTS,
    equality,
    make_batch,
    make_template,
    median_step,
    peak_step_bytes,
    resident_bytes,
    with_dead_latents,
)
from benchmarks.peer_overcomplete import Overcomplete
from benchmarks.peer_report import CONTENDER_HEADER, Row, contender_line, dead_cell, dead_fraction, fastest_peers
from benchmarks.peer_saelens import SAELens, SAELensCompiled
from benchmarks.peer_sparsify import Sparsify
from sae_pipeline.sae import MatchingPursuitSAE, SparseAutoencoder

PEERS: dict[str, tuple[type[Contender], tuple[str, ...]]] = {
    "SAELens": (SAELens, VARIANTS),
    "overcomplete": (Overcomplete, ("topk", "batchtopk", "jumprelu", "relu", "mpsae")),
    "sparsify": (Sparsify, ("topk",)),
    "dictionary_learning": (DictionaryLearning, DICTIONARY_LEARNING_VARIANTS),
    "SAELens+compile": (SAELensCompiled, VARIANTS),
}
DEFAULT_PEERS = [name for name in PEERS if name != "SAELens+compile"]  # compiling costs minutes on a CPU


def load_contenders(variant: str, template: SparseAutoencoder, args) -> tuple[list[Contender], list[str]]:
    contenders: list[Contender] = [Ours(variant, template, args.batch_size, args.k)]
    notes = []
    for library in args.peers:
        cls, variants = PEERS[library]
        if variant not in variants:
            continue
        try:
            contenders.append(cls(variant, template, args.batch_size, args.k))
        except ImportError as exn:
            notes.append(f"{library}: not installed ({exn.name}); pip install -e '.[bench]'")
    return contenders, notes


def run_block(variant: str, template: SparseAutoencoder, regime: str, x: torch.Tensor, args) -> list[Row]:
    """Every contender of ``variant`` from ``template``: equality, interleaved timing, memory; prints its rows."""
    device = x.device
    contenders, notes = load_contenders(variant, template, args)
    x_equal = x[: args.equal_rows]
    with torch.autocast(device.type, enabled=False):  # the same function, checked in float32 (or float64)
        equal = {
            c.name: "reference" if isinstance(c, Ours) else equality(variant, type(c), template, x_equal, args)
            for c in contenders
        }
    for c in list(contenders[1:]):  # a peer whose step fails (a compile, say) is reported, the others still run
        try:
            median_step(lambda: c.step(x), max(args.warmup, c.min_warmup), device)  # noqa: B023 (called at once)
        except Exception as exn:  # noqa: BLE001 (any failure of a peer's own code)
            notes.append(f"{c.name}: its step failed ({type(exn).__name__}: {str(exn).splitlines()[0][:200]})")
            contenders.remove(c)
    ours = contenders[0]
    median_step(lambda: ours.step(x), args.warmup, device)
    for note in notes:
        print(f"  note: {note}", flush=True)
    dead_before = {c.name: dead_fraction(c) for c in contenders}
    xc = (x - template.b_pre).detach()
    W_enc = template.W_dec.detach().T if isinstance(template, MatchingPursuitSAE) else template.W_enc.detach()
    gemm_times: list[float] = []
    step_times: dict[str, list[float]] = {c.name: [] for c in contenders}
    for _ in range(args.rounds):
        gemm_times += median_step(lambda: torch.mm(xc, W_enc), args.steps, device)  # noqa: B023 (called at once)
        for c in contenders:
            step_times[c.name] += median_step(lambda: c.step(x), args.steps, device)  # noqa: B023 (called at once)
    dead_after = {c.name: dead_fraction(c) for c in contenders}
    gemm = statistics.median(gemm_times)
    ours_time = statistics.median(step_times[ours.name])
    rows = []
    for c in contenders:
        row = Row(
            template.d_sae,
            variant,
            regime,
            c.library,
            c.name,
            statistics.median(step_times[c.name]),
            peak_step_bytes(c, x) / 2**20,
            equal[c.name],
        )
        dead = dead_cell(variant, dead_before[c.name], dead_after[c.name])
        print(contender_line(args.d_in, row, ours_time, gemm, resident_bytes(c) / 2**20, dead), flush=True)
        rows.append(row)
    return rows


def run_shape(d_sae: int, args) -> list[Row]:
    device = torch.device(args.device)
    x = make_batch(args.d_in, args.batch_size).to(device)
    rows = []
    for variant in args.variants:
        template = make_template(variant, args.d_in, d_sae, args.k, x.cpu()).to(args.device)
        templates = {"none": template}
        if variant in AUXK_VARIANTS and args.dead_fraction > 0:
            dead_template = with_dead_latents(template, x, args.dead_fraction)
            templates[f"{100 * float(dead_template.dead_mask().float().mean()):.1f} %"] = dead_template
        for regime, block_template in templates.items():
            rows += run_block(variant, block_template, regime, x, args)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next block's contenders start from the same free memory
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-in", type=int, default=768)
    parser.add_argument("--d-sae", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--peers",
        nargs="*",
        default=DEFAULT_PEERS,
        choices=list(PEERS),
        help=f"default: {' '.join(DEFAULT_PEERS)} (SAELens+compile: SAELens's compile_sae, minutes of compiling)",
    )
    parser.add_argument(
        "--dead-fraction",
        type=float,
        default=1 / 16,
        help="the TopK family's second timing: this fraction of the latents dead, AuxK on (0: no second timing)",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per contender per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender before the first round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument(
        "--equal-rows", type=int, default=None, help="rows of the batch the equality check uses (default: all)"
    )
    parser.add_argument(
        "--autocast",
        action="store_true",
        help="time every step and the GEMM under bf16 autocast (training's precision on a GPU); equality stays float32",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes, one round of 2 steps, 1 thread (a smoke run)"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        args.d_in, args.d_sae, args.batch_size, args.k = 16, [64], 32, 4
        args.steps, args.warmup, args.rounds = 2, 1, 1
        # at these sizes a second thread only adds hand-offs: 33 s with 2 threads, 2 s with 1, on a loaded 2-core box
        args.threads = 1 if args.threads is None else args.threads
    for name in ("d_in", "batch_size", "k", "steps", "rounds", "equal_rows"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if not 0 <= args.dead_fraction < 1:
        parser.error(f"--dead-fraction must be in [0, 1), got {args.dead_fraction}")
    for d_sae in args.d_sae:
        if not 1 <= args.k <= d_sae:
            parser.error(f"--k must be in [1, --d-sae={d_sae}], got {args.k}")
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        parser.error(f"--device {args.device}: no such device here; use --device cpu")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    if not args.device.startswith("cuda"):
        os.environ.setdefault("SPARSIFY_DISABLE_TRITON", "1")  # on CUDA sparsify decodes with Triton, as it trains
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    gpu = f"{torch.cuda.get_device_name(args.device)}; " if args.device.startswith("cuda") else ""
    precision = "bf16 autocast (equality in float32)" if args.autocast else "float32"
    print(
        f"machine: {gpu}{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, 1-minute load {load:.1f}; {precision}; B={args.batch_size} k={args.k}; "
        f"median over {args.rounds} rounds x {args.steps} steps",
        flush=True,
    )
    print(CONTENDER_HEADER, flush=True)
    device_type = torch.device(args.device).type
    rows = []
    for d_sae in args.d_sae:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.autocast):
            rows += run_shape(d_sae, args)
    print("\nThe fastest peer per variant (÷ ours > 1: ours is faster, or leaner):\n")
    print("\n".join(fastest_peers(rows)), flush=True)


if __name__ == "__main__":
    main()
