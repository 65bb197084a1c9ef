"""Benchmark: `fit` from shards as users run it, against the bare training step, in tokens/s, same run.

    python -m benchmarks.fit_pace                 # CUDA: TopK and MP-SAE, configs/vision/<variant>.yaml (d_sae 19 200,
                                                  # k 32, B 4 096, bf16-mixed) on synthetic DINOv2-shaped shards
    python -m benchmarks.fit_pace --workers 8     # the loader's workers (default: the recipe's 4)
    python -m benchmarks.fit_pace --dry-run       # CPU, tiny sizes, float32 (benchmarks/gpu_suite.py's dry run)

Why: a step of about 1 ms (TopK at the paper's shape on an H200) asks the loader for ~6 GB/s of float16
tokens; a training service is as fast as its `fit`, not its step. Each variant is timed three ways in one
call: the bare step (`benchmarks/gpu.py`'s, the SAE's whole step on one batch already on the device), `fit`
reading the shards with ``--workers`` loader workers, and `fit` with ``--data.cache gpu`` (the training split
in device memory: ``ram`` in the dry run). Each `fit` is the real command (``python -m sae_pipeline fit
--config configs/vision/<variant>.yaml``, its logger, logging steps and checkpoint included) with one
callback added, `StepTimes`, that synchronises the device twice: after ``--warmup`` steps and after
``--steps`` more; tokens/s = batch · steps / the time between. The ratio to the bare step is the issue's
figure (target: ≥ 0.90 for TopK and MP-SAE).

The shards: ``--images`` synthetic DINOv2-shaped images (261 tokens of d 768, float16; `benchmarks/rehearsal/
shards.py`), written once to a temporary folder, one shard of eight held out for validation; the timed steps
lie within the first epoch, after the shuffle buffer has filled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

REPO_DPATH = Path(__file__).resolve().parents[1]
VARIANTS = ("topk", "mpsae")
TIMES_ENV = ("SAE_PIPELINE_FIT_PACE_OUT", "SAE_PIPELINE_FIT_PACE_STEPS")  # the callback's output file; "warmup:steps"


class StepTimes(L.Callback):
    """Wall time between the ends of step ``warmup`` and step ``warmup + steps``, the device synchronised at
    both (and only there: a sync per step would hide the overlap of loading and computing that is measured)."""

    def __init__(self) -> None:
        self.out = os.environ.get(TIMES_ENV[0])
        warmup, steps = os.environ.get(TIMES_ENV[1], "0:0").split(":")
        self.warmup, self.steps, self.start = int(warmup), int(steps), None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        step = trainer.global_step
        if self.out is None or step not in (self.warmup, self.warmup + self.steps):
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        if step == self.warmup:
            self.start = now
        elif self.start is not None:
            Path(self.out).write_text(json.dumps({"steps": self.steps, "seconds": now - self.start}))


def fit_tokens_per_second(variant: str, mode: str, shards: Path, out: Path, args: argparse.Namespace) -> float:
    """Runs the real `fit` command once; returns its tokens/s over the timed steps."""
    times = out / f"{variant}_{mode}.json"
    argv = [sys.executable, "-m", "sae_pipeline", "fit", "--config", str(REPO_DPATH / f"configs/vision/{variant}.yaml")]
    argv += ["--data.source", str(shards), "--data.val_fraction", "0.125", "--data.num_workers", str(args.workers)]
    argv += ["--trainer.max_steps", str(args.warmup + args.steps + 1), "--trainer.num_sanity_val_steps", "0"]
    argv += ["--trainer.default_root_dir", str(out / "runs"), "--trainer.enable_progress_bar", "false"]
    argv += ["--trainer.callbacks+=benchmarks.fit_pace.StepTimes"]
    if mode == "cache":
        argv += ["--data.cache", "ram" if args.dry_run else "gpu"]
    if args.dry_run:
        argv += ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true"]
    argv += ["--model.sae.init_args.d_sae", str(args.d_sae), "--model.sae.init_args.k", str(args.k)]
    argv += ["--data.batch_size", str(args.batch_size), "--data.shuffle_buffer_tokens", str(16 * args.batch_size)]
    env = {**os.environ, TIMES_ENV[0]: str(times), TIMES_ENV[1]: f"{args.warmup}:{args.steps}"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_DPATH), env.get("PYTHONPATH")]))
    done = subprocess.run(argv, cwd=out, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not times.is_file():
        raise SystemExit(f"fit ({variant}, {mode}) failed with exit {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(times.read_text())
    return args.batch_size * result["steps"] / result["seconds"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--workers", type=int, default=4, help="the loader's workers (default: the recipe's 4)")
    parser.add_argument("--images", type=int, default=2000, help="synthetic images (261 tokens each)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, float32: checks the script runs")
    args = parser.parse_args(argv)
    args.d_in, args.d_sae, args.k, args.batch_size = 768, 19200, 32, 4096
    if args.dry_run:
        args.d_in, args.d_sae, args.k, args.batch_size = 32, 256, 4, 64
        args.images, args.steps, args.warmup, args.workers = 40, 4, 2, 1
    elif not torch.cuda.is_available():
        parser.error("no CUDA device is visible: run on a GPU machine, or use --dry-run for the CPU check")
    for name in ("workers", "images", "steps", "warmup"):
        if getattr(args, name) < (0 if name == "workers" else 1):
            parser.error(f"--{name} must be >= {0 if name == 'workers' else 1}, got {getattr(args, name)}")
    tokens_per_epoch = args.images * 7 // 8 * 261
    if (args.warmup + args.steps + 1) * args.batch_size > tokens_per_epoch:
        parser.error(f"--images {args.images} holds fewer than --warmup + --steps + 1 batches in its training split")
    return args


def main(argv: list[str] | None = None) -> None:
    from benchmarks.gpu import sae_step_seconds
    from benchmarks.rehearsal.shards import write

    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU dry run"
    cached = "ram" if args.dry_run else "gpu"
    print(
        f"device: {name}; d_sae={args.d_sae} k={args.k} B={args.batch_size}; {args.images} images "
        f"(261 tokens of d {args.d_in}); {args.steps} steps timed after {args.warmup}; {args.workers} workers"
    )
    with tempfile.TemporaryDirectory(prefix="fit_pace_") as tmp:
        out = Path(tmp)
        start = time.perf_counter()
        write(out, args.images, d=args.d_in, shard_size=-(-args.images // 8))
        print(f"shards written in {time.perf_counter() - start:.1f} s")
        print(f"| variant | bare step tokens/s | fit, {args.workers} workers | ratio | fit, cache {cached} | ratio |")
        print("|---|---|---|---|---|---|")
        for variant in args.variants:
            x = torch.randn(args.batch_size, args.d_in, device=device) + torch.randn(args.d_in, device=device)
            bare = args.batch_size / sae_step_seconds(variant, args, x, autocast=device.type == "cuda")
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()
            shards = out / "shards"
            workers = fit_tokens_per_second(variant, "workers", shards, out, args)
            cache = fit_tokens_per_second(variant, "cache", shards, out, args)
            cells = [variant, f"{bare:,.0f}", f"{workers:,.0f}", f"{workers / bare:.2f}", f"{cache:,.0f}"]
            print("| " + " | ".join([*cells, f"{cache / bare:.2f}"]) + " |", flush=True)


if __name__ == "__main__":
    main()
