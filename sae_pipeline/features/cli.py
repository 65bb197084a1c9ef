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
read-only file system or a mount point, ``--intervene`` on data whose backbone cannot be rebuilt, a
``--replicas`` SAE that is not another seed of the same variant and size) is a
one-line ``ValueError`` that ``python -m sae_pipeline`` prints with exit code 2, before the pass starts and
before anything is written.

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
from typing import Any

from feature_extraction.exit_status import Interrupted, flag_error
from feature_extraction.output_lock import output_lock
from feature_extraction.validate import check_float, check_int
from sae_pipeline.features.flags import PROG, build_parser, resolve_settings


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
    check_int("--intervene_atoms", args.intervene_atoms, 0, note=" (atoms measured by --intervene; 0: all)")
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
    from sae_pipeline.features.replicas import load_replicas, match_replicas

    replica_decoders = load_replicas(args.replicas, sae)  # before the pass: a bad replica is one line
    backbone = None
    if args.intervene:  # before the pass: a backbone that cannot be rebuilt is one line
        from sae_pipeline.features.interventions import backbone_of_data

        backbone = backbone_of_data(datamodule, args.checkpoint_path, sae.d_in)
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
    replicas = match_replicas(sae, replica_decoders, args.replicas) if replica_decoders else None
    interventions = None
    if backbone is not None:
        from sae_pipeline.features.interventions import intervene_site

        device = str(trainer.strategy.root_device)
        interventions = intervene_site(
            sae, backbone, module.state, module.collection, args.atoms, args.intervene_atoms, args.images, device
        )
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
        replicas=replicas,
        interventions=interventions,
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
