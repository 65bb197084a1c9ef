"""How soon JumpReLU and ReLU reach their L0 on ViT-like tokens: the backbone configs' settings against the
paper's recipe, measured in the same run (bf16 autocast, through the real CLI).

The backbone configs set ``threshold_lr_scale: 100`` (JumpReLU: log θ keeps pace with the encoder) and
``initial_l0: 32`` (ReLU: b_enc starts each latent on 32/d_sae of the tokens). Without them, as in the
JumpReLU paper's and the classic ReLU SAE's recipe, a short run ends far from the L0 it aims at. The
recipe is ``benchmarks/backbone_recipe.py``'s, the one ``tests/test_backbone_configs_bf16.py`` asserts on.
Prints per run the validation L0, its ratio to the target and R²; ``--figure`` draws the training L0
against the step.

    python -m benchmarks.short_run_sparsity                     # 300 steps, the test's length
    python -m benchmarks.short_run_sparsity --steps 3000 --figure docs/figures/short_run_sparsity.png
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks.backbone_recipe import CONFIGS_DPATH, fit_args, target_l0, write_vit_like_shards
from sae_pipeline.cli import SAECLI
from sae_pipeline.config_files import load_config

# (config, setting, extra flags): the configs as they are, then the same run without the setting
RUNS = [
    ("jumprelu_dinov2", "threshold_lr_scale 100 (config)", []),
    ("jumprelu_dinov2", "threshold_lr_scale 1 (paper)", ["--model.sae.init_args.threshold_lr_scale", "1"]),
    ("relu_dinov2", "initial_l0 32 (config)", []),
    ("relu_dinov2", "b_enc = 0 (no initial_l0)", ["--model.sae.init_args.initial_l0", "null"]),
]


def train_l0_curve(log_dpath: str) -> tuple[list[int], list[float]]:
    events = EventAccumulator(log_dpath, size_guidance={"scalars": 0})
    events.Reload()
    points = events.Scalars("train/l0")
    return [p.step for p in points], [p.value for p in points]


def run(stem: str, extra: list[str], shards: Path, work_dpath: Path, steps: int) -> dict:
    config_fpath = CONFIGS_DPATH / f"{stem}.yaml"
    config = load_config(config_fpath)  # the shortcut with its pieces
    work_dpath.mkdir(parents=True)
    os.chdir(work_dpath)
    started = time.perf_counter()
    cli = SAECLI(
        args=[
            *fit_args(config_fpath, config, shards, steps),
            *extra,
            "--trainer.log_every_n_steps",
            str(max(1, steps // 60)),
        ]
    )
    metrics = cli.trainer.callback_metrics
    steps_logged, l0s = train_l0_curve(cli.trainer.logger.log_dir)
    return {
        "l0": float(metrics["val/l0"]),
        "r2": float(metrics["val/r2"]),
        "target": target_l0(config),
        "seconds": time.perf_counter() - started,
        "steps": steps_logged,
        "train_l0": l0s,
    }


def draw(results: list[tuple[str, str, dict]], fpath: Path) -> None:
    fig = Figure(figsize=(9.0, 3.6), layout="constrained")
    for axes, stem in zip(fig.subplots(1, 2), ("jumprelu_dinov2", "relu_dinov2")):
        for name, setting, result in results:
            if name == stem:
                axes.plot(result["steps"], result["train_l0"], label=setting)
        target = next(r["target"] for name, _, r in results if name == stem)
        axes.axhline(target, color="0.4", linestyle="--", linewidth=1, label=f"target {target:g}")
        axes.set(
            yscale="log",
            xlabel="training step",
            ylabel="train L0 (active latents per token)",
            title=f"{stem.split('_')[0]} on ViT-like tokens, bf16",
        )
        axes.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 10, 20, 50, 100, ...
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 20, not 2 x 10^1
        axes.yaxis.set_minor_formatter(NullFormatter())
        axes.legend(fontsize=8)
    fpath.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(fpath, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (the test's 300)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--figure", type=Path, help="PNG of the training L0 against the step")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2, got {args.steps}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    sys.argv = sys.argv[:1]  # LightningCLI(args=...) warns when sys.argv holds arguments too
    cwd = os.getcwd()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_vit_like_shards(Path(tmp) / "shards")
        try:
            for index, (stem, setting, extra) in enumerate(RUNS):
                results.append((stem, setting, run(stem, extra, shards, Path(tmp) / f"run{index}", args.steps)))
        finally:
            os.chdir(cwd)  # out of the temporary directory before it is removed, also after a failed run
    print(f"{args.steps} steps, d 64, p 512, bf16 autocast, {args.threads} threads (benchmarks/backbone_recipe.py)\n")
    print("| config | setting | val L0 | target | L0 / target | val R² | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for stem, setting, r in results:
        print(
            f"| {stem} | {setting} | {r['l0']:.1f} | {r['target']:g} | {r['l0'] / r['target']:.2f} | "
            f"{r['r2']:.3f} | {r['seconds']:.0f} |"
        )
    for stem in ("jumprelu_dinov2", "relu_dinov2"):
        config_ratio, paper_ratio = (r["l0"] / r["target"] for name, _, r in results if name == stem)
        print(f"\n{stem}: L0 / target {config_ratio:.2f} with the config's setting vs {paper_ratio:.2f} without")
    if args.figure:
        draw(results, args.figure)
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
