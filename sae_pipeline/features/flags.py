"""The flags of ``python -m sae_pipeline features`` and how they combine with a training config.

Why apart from the command: the flags are what a user reads in ``--help`` and the docs check
(tests/test_help.py, docs/features.md); the command (`sae_pipeline.features.cli`) is the run.
``--config`` takes the training config: its ``data`` section and the device settings of its
``trainer`` section are used, the rest ignored; flags override both (`resolve_settings`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from feature_extraction.help_format import DefaultsHelpFormatter
from sae_pipeline.config_files import load_config

PROG = "python -m sae_pipeline features"
DATA_KEYS = ("source", "batch_size", "num_workers", "data_dpath", "allow_download")
TRAINER_KEYS = ("accelerator", "devices", "num_nodes", "strategy", "precision")
DEFAULTS = {
    "data.batch_size": 4096,
    "data.num_workers": 2,
    "data.data_dpath": "data",
    "data.allow_download": False,
    "trainer.accelerator": "auto",
    "trainer.devices": "auto",
    "trainer.num_nodes": 1,
    "trainer.strategy": "auto",
    "trainer.precision": "32-true",
}


def build_parser() -> Any:
    """The flags (jsonargparse, as every command; ``--config`` here is a training config, read below)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        prog=PROG,
        formatter_class=DefaultsHelpFormatter,
        exit_on_error=False,
        description="One streaming pass of a trained SAE over a dataset, then a static HTML site in --out: an "
        "index of every atom and a page per atom with its top images, activation heatmaps and nearest "
        "atoms, and a page per image with the atoms that fire most on it. Opens from disk (OUT/index.html) or "
        "through python -m http.server. Your own images: python -m sae_pipeline features explain --help.",
    )
    parser.add_argument(
        "--config",
        help="a training config (configs/<variant>_<data>.yaml): its data section and trainer device settings are used",
    )
    parser.add_argument(
        "--ckpt_path",
        help="checkpoint written by `fit`, or `last`: the newest of the --config's runs under --runs (or give --sae)",
    )
    parser.add_argument("--runs", default="runs", help="where `fit` wrote the runs (for --ckpt_path last)")
    parser.add_argument("--name", help="the member of a group's checkpoint (fit of model.members) to browse")
    parser.add_argument(
        "--sae",
        help="an exported SAE directory: ours (config.json + sae.safetensors) or "
        "SAELens's (cfg.json + sae_weights.safetensors)",
    )
    parser.add_argument("--out", required=True, help="site directory (created; a previous site there is replaced)")
    parser.add_argument("--top", type=int, default=16, help="top images kept per atom")
    parser.add_argument("--images", help="where the extraction's images are now, when they have moved")
    parser.add_argument("--atoms", type=int, nargs="+", help="only these atom ids get pages (default: every atom)")
    parser.add_argument("--neighbours", type=int, default=8, help="nearest atoms (by cosine) listed per atom")
    parser.add_argument(
        "--fdr",
        type=float,
        default=0.05,
        help="false-discovery rate (Benjamini-Hochberg over atoms) at which an atom's label selectivity beats chance",
    )
    parser.add_argument(
        "--replicas",
        type=str,
        nargs="+",
        help="the other seeds' SAEs of the same variant and setting (export folders, fit checkpoints, a group's "
        "member as FILE.ckpt:NAME, run folders): each atom page says in how many seeds the atom is found again",
    )
    parser.add_argument(
        "--intervene",
        action="store_true",
        help="also remove each measured atom inside the backbone on its top images and measure the model's output "
        "change against a matched removal (atom pages, section 'Removed inside the backbone'); shards with a "
        "recorded backbone only; costs about 2 x --top backbone forwards per atom plus 2 per image shown",
    )
    parser.add_argument(
        "--intervene_atoms",
        type=int,
        default=32,
        help="with --intervene: the atoms measured, those with a page that fire on most tokens (0: every atom with "
        "a page)",
    )
    parser.add_argument(
        "--checkpoint_path",
        help="with --intervene: the backbone's weights file (.safetensors or state dict) when the one the "
        "extraction recorded has moved",
    )
    for key in DATA_KEYS:
        kind = {"batch_size": Optional[int], "num_workers": Optional[int], "allow_download": Optional[bool]}.get(
            key, Optional[str]
        )
        parser.add_argument(
            f"--data.{key}",
            type=kind,
            default=None,
            help=f"as `fit --data.{key}` (default: the config's, else {DEFAULTS.get('data.' + key)})",
        )
    for key in TRAINER_KEYS:
        kind = Optional[int] if key == "num_nodes" else Optional[str]
        parser.add_argument(
            f"--trainer.{key}",
            type=kind,
            default=None,
            help=f"as `fit --trainer.{key}` (default: the config's, else {DEFAULTS.get('trainer.' + key)})",
        )
    return parser


def resolve_settings(args: Any) -> dict[str, Any]:
    """Flags over the config file over the defaults, as ``{"data.source": ..., "trainer.devices": ...}``."""
    settings = dict(DEFAULTS)
    if args.config:
        fpath = Path(args.config)
        if not fpath.is_file():
            raise ValueError(
                f"--config {fpath}: file not found; pass a training config such as configs/mpsae_digits.yaml"
            )
        config = load_config(fpath)  # its includes resolved
        for section, keys in (("data", DATA_KEYS), ("trainer", TRAINER_KEYS)):
            for key in keys:
                if isinstance(config.get(section), dict) and key in config[section]:
                    settings[f"{section}.{key}"] = config[section][key]
    for name in (*(f"data.{key}" for key in DATA_KEYS), *(f"trainer.{key}" for key in TRAINER_KEYS)):
        if args.get(name) is not None:
            settings[name] = args.get(name)
    if not settings.get("data.source"):
        raise ValueError(
            "no data: pass --data.source (a shard directory, an .h5 token cache, digits or mnist) or "
            "--config with a data section"
        )
    devices = settings["trainer.devices"]
    if isinstance(devices, str) and devices.isdigit():
        settings["trainer.devices"] = int(devices)
    return settings
