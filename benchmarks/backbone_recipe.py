"""The backbone configs (``configs/*_dinov2.yaml``) scaled down to a CPU run on synthetic ViT-like tokens.

Why one module, kept with the benchmarks (tests may import benchmarks, never the reverse):
``tests/test_backbone_configs_bf16.py`` asserts that every config reaches its sparsity
in such a run, and ``benchmarks/short_run_sparsity.py`` draws how each threshold variant gets there
with and without the configs' settings; both must train exactly the same recipe. Each config keeps its
own optimiser, schedule and every ``init_args`` key; only the size changes: d = 64 tokens, p = 512
atoms, 300 steps of 256 tokens, and warm-ups cut by the same factor as the run length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.vit_like_tokens import vit_like_tokens
from feature_extraction.shards import write_manifest, write_shard

CONFIGS_DPATH = Path(__file__).resolve().parents[1] / "configs"
D, P, STEPS, BATCH = 64, 512, 300, 256
TOKENS_PER_IMAGE, IMAGES_PER_SHARD, N_SHARDS = 16, 64, 10  # 10 240 tokens; 1 shard (1024 tokens) validates
RUN_SHARE = STEPS / 20_000  # the configs' warm-ups are sized for ~10^5 steps: keep their share of the run


def dinov2_configs() -> list[Path]:
    return sorted(p for p in CONFIGS_DPATH.glob("*_dinov2.yaml") if not p.name.startswith("extract_"))


def write_vit_like_shards(dpath: Path) -> Path:
    """``N_SHARDS`` finished shards of ViT-like tokens (seed 0) in ``dpath``."""
    tokens = vit_like_tokens(N_SHARDS * IMAGES_PER_SHARD * TOKENS_PER_IMAGE, D, seed=0)
    images = tokens.reshape(N_SHARDS, IMAGES_PER_SHARD, TOKENS_PER_IMAGE, D).astype(np.float16)
    for s in range(N_SHARDS):
        write_shard(dpath, s, [(f"img{s:02d}_{i:03d}", images[s, i], {"label": 0}) for i in range(IMAGES_PER_SHARD)])
    write_manifest(
        dpath,
        n_shards=N_SHARDS,
        spec={"name": "vit_like"},
        layer=-1,
        tokens_per_image=TOKENS_PER_IMAGE,
        n_prefix_tokens=1,
        grid=(3, 5),
    )
    return dpath


def target_l0(config: dict) -> float:
    """``k``, ``target_l0``, or (ReLU) ``initial_l0``."""
    init_args = config["model"]["sae"]["init_args"]
    for key in ("k", "target_l0", "initial_l0"):
        if key in init_args:
            return float(init_args[key])
    raise AssertionError(f"{config['model']['sae']['class_path']}: a new variant? say here what its L0 target is")


def scaled_args(config: dict) -> list[str]:
    """The recipe scaled down: d_sae, run length, and warm-up lengths as the same share of the run."""
    args = [
        "--model.sae.init_args.d_sae",
        str(P),
        "--model.warmup_steps",
        str(max(1, round(config["model"]["warmup_steps"] * RUN_SHARE))),
    ]
    for key, value in config["model"]["sae"]["init_args"].items():
        if key.endswith("warmup_steps"):
            args += [f"--model.sae.init_args.{key}", str(max(1, round(value * RUN_SHARE)))]
    return args


def fit_args(config_fpath: Path, config: dict, shards: Path, steps: int = STEPS) -> list[str]:
    """``SAECLI`` arguments of one scaled run on one CPU, validated once at its end."""
    return [
        "fit",
        "--config",
        str(config_fpath),
        *scaled_args(config),
        "--data.source",
        str(shards),
        "--data.batch_size",
        str(BATCH),
        "--data.num_workers",
        "0",
        "--data.val_fraction",
        str(1 / N_SHARDS),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        "--trainer.max_steps",
        str(steps),
        "--trainer.max_epochs",
        "-1",
        "--trainer.val_check_interval",
        str(steps),
        "--trainer.check_val_every_n_epoch",
        "null",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
    ]
