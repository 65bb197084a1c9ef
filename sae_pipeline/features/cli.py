"""``python -m sae_pipeline features``: build the feature browser of a trained SAE.

    python -m sae_pipeline features --config configs/mpsae_digits.yaml --ckpt_path last --out site/   # newest run
    python -m sae_pipeline features --sae exported/ --data.source shards/dinov2 --out site/ --trainer.devices 4
    python -m sae_pipeline features ... --images /new/place/of/imagenet/train   # images moved since extraction
    python -m sae_pipeline features explain --sae exported/ --images photo.jpg --site site/   # your own images

``features explain`` is a subcommand of its own (:mod:`sae_pipeline.features.explain`).

``--config`` takes the training config: its ``data`` section and the device settings of its
``trainer`` section (accelerator, devices, num_nodes, strategy, precision) are used, the rest
is ignored; flags override them. Every rank runs this same command (Lightning starts the
other processes, or ``srun`` does); rank 0 writes the site.

An image replaced or edited since extraction (its content hash no longer matches) is not
drawn: the command names it on stderr and the index page lists it. Images of shards written
before content hashes were recorded are drawn unchecked, and the command says so once.

Bad input (no SAE, ``--top 0``, an atom id outside the dictionary, data whose width is not
the SAE's ``d_in``, images no longer where the shards say, ``--out`` holding something else, on a
read-only file system or a mount point) is a one-line ``ValueError`` that ``python -m sae_pipeline`` prints with exit
code 2, before the pass starts and before anything is written.

Ctrl-C or SIGTERM, during the pass or while the site is written, stops it within seconds with exit
130 / 143 (:mod:`sae_pipeline.training.interrupts`): the site is built in a staging folder beside ``--out``
and swapped in whole at the end, so an interruption leaves the previous site (or nothing) in
``--out``; the one line says so and to rerun the same command. A stop that lands during the swap waits
for it (in whichever thread it lands): the new site is then in place, and the line says that instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

from feature_extraction.exit_status import Interrupted, flag_error
from feature_extraction.help_format import DefaultsHelpFormatter
from feature_extraction.output_lock import output_lock
from feature_extraction.validate import check_float, check_int
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


def load_model(args: Any):  # noqa: ANN201 -- SparseAutoencoder; imported lazily
    """The SAE on raw activations, from ``--ckpt_path`` (input scale folded) or ``--sae``."""
    from sae_pipeline.artifacts import load_sae
    from sae_pipeline.artifacts.checkpoint import checkpoint_input_scale, read_checkpoint, sae_from_checkpoint

    if bool(args.ckpt_path) == bool(args.sae):
        raise ValueError("pass exactly one of --ckpt_path FILE (a checkpoint of `fit`) and --sae DIR (an export)")
    if args.sae:
        if not Path(args.sae).is_dir():
            raise ValueError(
                f"--sae {args.sae}: not a directory; pass an export (config.json + sae.safetensors) or "
                "a SAELens directory (cfg.json + sae_weights.safetensors)"
            )
        return load_sae(args.sae)
    if args.ckpt_path == "last":
        from sae_pipeline.training.checkpointing import newest_checkpoint

        if not args.config:
            raise ValueError("--ckpt_path last needs --config (the newest run of that config); or pass the .ckpt file")
        run_dpath = Path(args.runs) / Path(args.config).stem
        found = newest_checkpoint([run_dpath])
        if found is None:
            raise ValueError(
                f"--ckpt_path last: no checkpoint under {run_dpath}; train one first with fit, or pass "
                "--runs DIR (where fit wrote its runs)"
            )
        args.ckpt_path = str(found)
    checkpoint = read_checkpoint(args.ckpt_path, need=("input_scale",), last=True, name=args.get("name"))
    sae = sae_from_checkpoint(checkpoint, f"--ckpt_path {args.ckpt_path}")
    sae.fold_input_scale(checkpoint_input_scale(checkpoint, f"--ckpt_path {args.ckpt_path}"))
    return sae.eval()


def check_inputs(args: Any, sae: Any, datamodule: Any) -> None:
    """Every one-line refusal that can be known before the pass."""
    from sae_pipeline.data.sources import ShardSource
    from sae_pipeline.features.images import SourceImages
    from sae_pipeline.features.site_dir import check_out_dir, remove_stale_partials

    check_int("--top", args.top, 1, note=" (images kept per atom)")
    check_int("--neighbours", args.neighbours, 0)
    check_float("--fdr", args.fdr, 0, 1, strict_minimum=True, strict_maximum=True, note=" (a false-discovery rate)")
    if args.atoms:
        bad = [atom for atom in args.atoms if not 0 <= atom < sae.d_sae]
        if bad:
            raise ValueError(
                f"--atoms {bad[0]}: out of range; the SAE has d_sae = {sae.d_sae} atoms, ids 0..{sae.d_sae - 1}"
            )
    if datamodule.d_in != sae.d_in:
        raise ValueError(
            f"--data.source {datamodule.source}: tokens are {datamodule.d_in}-d but the SAE takes d_in = "
            f"{sae.d_in}; pass the data it was trained on (or the SAE trained on this data)"
        )
    source = datamodule.data_source
    if isinstance(source, ShardSource):
        from feature_extraction.shards import shard_fpaths
        from feature_extraction.shards.read import read_shard_samples

        fpaths = shard_fpaths(source.name, source.manifest)
        if fpaths:
            for _, _, _, _, meta in read_shard_samples(fpaths[0], [0]):
                SourceImages(args.images).check(meta)
    check_out_dir(Path(args.out))
    remove_stale_partials(Path(args.out))


def main(argv: list[str] | None = None) -> int:
    """Errors are ValueErrors, printed by ``python -m sae_pipeline`` (one line, exit 2; ranks > 0 a little later)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["explain"]:
        from sae_pipeline.features.explain import main as explain_main

        return explain_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as error:
        raise ValueError(f"{flag_error(error)} (see {PROG} --help)") from None
    settings = resolve_settings(args)
    from sae_pipeline.features.site_dir import site_identity
    from sae_pipeline.training.interrupts import interruption  # loaded already under python -m sae_pipeline

    before = site_identity(Path(args.out))
    try:
        with output_lock(args.out, "features", beside=True):  # the site is swapped in whole: the lock is beside it
            written = write_site(args, settings)
    except BaseException as exn:  # stopped anywhere: the line says which site is in --out now
        stop = interruption(exn)
        if stop is None:
            raise
        stop.detail = stop.detail or stopped_detail(Path(args.out), before)
        raise stop from (None if stop is exn else exn)
    if written is not None:  # rank 0
        out, done = written
        report_image_checks(out)
        print(
            f"{done}: open {out / 'index.html'} (or: python -m http.server --directory {out}, then "
            "http://localhost:8000)",
            flush=True,
        )
    return 0


def stopped_detail(out: Path, before: tuple[int, int] | None) -> str:
    """What a stop leaves in ``out``: the new site (the stop came after its swap), the previous one, or none."""
    from sae_pipeline.features.site_dir import site_identity

    now = site_identity(out)
    if now is not None and now != before:
        return f"the new site is in place in {out}, whole (the stop came after its swap); open {out / 'index.html'}"
    kept = "the previous site there is unchanged" if now is not None else "nothing was written there"
    return f"no site written to {out} ({kept}); rerun the same command"


def write_site(args: argparse.Namespace, settings: dict[str, Any]) -> tuple[Path, str] | None:
    """The pass over the data, then the site (rank 0): its folder and what was done, None on other ranks."""
    start = time.perf_counter()

    import lightning as L

    from sae_pipeline.data import ActivationDataModule
    from sae_pipeline.features.heatmaps import layout_of
    from sae_pipeline.features.pass_module import FeaturesModule
    from sae_pipeline.features.site import build_site
    from sae_pipeline.training.interrupts import Interrupts

    sae = load_model(args)
    batch_size = int(settings["data.batch_size"])
    datamodule = ActivationDataModule(
        settings["data.source"],
        batch_size=batch_size,
        num_workers=int(settings["data.num_workers"]),
        shuffle_buffer_tokens=batch_size,
        val_fraction=0.0,
        data_dpath=str(settings["data.data_dpath"]),
        allow_download=bool(settings["data.allow_download"]),
    )
    check_inputs(args, sae, datamodule)
    layout = layout_of(datamodule.data_source)
    module = FeaturesModule(sae, args.top, layout, data_dpath=str(settings["data.data_dpath"]))
    trainer = L.Trainer(
        accelerator=settings["trainer.accelerator"],
        devices=settings["trainer.devices"],
        num_nodes=int(settings["trainer.num_nodes"]),
        strategy=settings["trainer.strategy"],
        precision=settings["trainer.precision"],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        inference_mode=True,
        callbacks=[Interrupts(), pass_progress_bar()],
    )
    trainer.predict(module, datamodule=datamodule)
    if trainer.global_rank != 0:
        return None
    assert module.state is not None and module.collection is not None
    out = build_site(
        Path(args.out),
        sae.cpu(),
        module.state,
        module.collection,
        layout,
        datamodule,
        images_dpath=args.images,
        atoms=args.atoms,
        n_neighbours=args.neighbours,
        fdr=args.fdr,
    )
    n_tokens = int(module.state["n_tokens"])
    return (
        out,
        f"feature browser for {sae.d_sae} atoms over {n_tokens} tokens written in {time.perf_counter() - start:.0f} s",
    )


def pass_progress_bar() -> Any:
    """Lightning's progress bar (Rich where installed), labelled for this pass rather than "Predicting"."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    try:
        import rich  # noqa: F401

        base = RichProgressBar
    except ImportError:
        base = TQDMProgressBar
    return type(
        "FeaturesPassBar",
        (StopsQuietly, base),
        {"predict_description": property(lambda self: "Features pass")},
    )()


class StopsQuietly:
    """A progress bar whose own teardown cannot replace a stop (SIGTERM / Ctrl-C) with its error.

    A signal that lands while Rich starts its refresh thread leaves the display half started, and
    its ``stop()`` then raises; Lightning would skip the rest of its exception handling for it.
    """

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            super().on_exception(trainer, pl_module, exception)  # type: ignore[misc]
        except Exception:
            if not isinstance(exception, Interrupted):
                raise


def report_image_checks(out: Path) -> None:
    """On stderr: the images not drawn because they changed since extraction, how many went unchecked, and an
    ``--fdr`` that no atom can reach with these labelled images."""
    import json

    from feature_extraction.file_checks import terminal_text
    from sae_pipeline.features.site_dir import MARKER_FNAME

    summary = json.loads((out / MARKER_FNAME).read_text())  # the site this run just wrote
    changed = summary.get("images_changed") or []
    if changed:
        # image ids and places come from the shards (another program's files): escaped for the terminal
        shown = [f"{terminal_text(c['image_id'], 120)} ({terminal_text(c['where'], 120)})" for c in changed[:10]]
        names = "; ".join(shown)
        more = f"; and {len(changed) - 10} more" if len(changed) > 10 else ""
        print(
            f"warning: {len(changed)} images changed since extraction, not drawn (listed on the index page): "
            f"{names}{more}",
            file=sys.stderr,
            flush=True,
        )
    if summary.get("images_unchecked"):
        print(
            f"warning: {summary['images_unchecked']} images drawn unchecked: their shards predate content hashes "
            "(re-extract to check them)",
            file=sys.stderr,
            flush=True,
        )
    unreachable = ((summary.get("labels") or {}).get("chance") or {}).get("unreachable")
    if unreachable:
        print(f"warning: {unreachable}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
