"""The flags of `python -m sae_pipeline.evaluate`: one subcommand per study, and those of its other commands.

Every subcommand's flags in one place (jsonargparse: `--config FILE` sets any of them, and `--help` shows each
default), apart from what the subcommands do (`sae_pipeline.evaluate.__main__`, `.study_runner`). Light: it
loads no torch, so `--help` and a bad flag answer at once; the variants are checked against the registry only
once the flags parsed.
"""

from __future__ import annotations

from typing import Any

from feature_extraction.help_format import DefaultsHelpFormatter
from sae_pipeline.evaluate import runs

PROG = "python -m sae_pipeline.evaluate"


def _parser(**kwargs: Any) -> Any:
    """A jsonargparse parser whose ``--help`` shows the defaults; errors are left to ``run_cli`` (one line)."""
    from jsonargparse import ArgumentParser

    return ArgumentParser(formatter_class=DefaultsHelpFormatter, exit_on_error=False, **kwargs)


def build_parser() -> Any:
    """The flags of every subcommand (jsonargparse: ``--config FILE`` sets any of a subcommand's flags)."""
    from jsonargparse import ActionConfigFile
    from jsonargparse.typing import PositiveInt

    # allow_abbrev: else the top level would read a study's --p as an abbreviation of its own --print_shtab.
    parser = _parser(
        prog=PROG,
        allow_abbrev=False,
        description="Reproduce the paper's controlled experiment (expressivity, "
        "inference-time k, coherence, learned concepts) over the SAE variants, training each "
        "model through `python -m sae_pipeline fit`.",
    )
    commands = parser.add_subcommands(dest="command", required=True)

    def add(name: str, help: str) -> Any:  # noqa: A002 (argparse's word)
        sub = _parser(description=help[0].upper() + help[1:] + ".")
        sub.add_argument("--config", action=ActionConfigFile, help="YAML file setting any of the options below")
        commands.add_subcommand(name, sub, help=help)
        return sub

    for name in (*runs.STUDIES, "probing", "all"):
        what = {"all": "run every study but probing", "probing": "run the sparse probing study (labelled data)"}
        sub = add(name, what.get(name, f"run the {name} study"))
        sub.add_argument(
            "--data",
            default="digits",
            help="digits (bundled), mnist_sample (5000 real MNIST digits, "
            "extra 'mnist'), mnist, a shard directory or an .h5 token cache",
        )
        sub.add_argument("--out", required=True, help="output folder: runs, models, figures, results.json, report.md")
        sub.add_argument(
            "--variants",
            nargs="+",
            default=None,
            help="registry keys of the variants to train "
            "(relu jumprelu topk batchtopk mpsae ...; default: every registered variant)",
        )
        sub.add_argument("--k", nargs="+", type=PositiveInt, default=[5, 10, 20, 40], help="training sparsities")
        sub.add_argument("--k_main", type=PositiveInt, default=10, help="k of the p sweep, coherence and concepts")
        sub.add_argument(
            "--p",
            nargs="+",
            type=PositiveInt,
            default=[125, 250, 500, 1000, 2000],
            help="dictionary sizes of the p sweep",
        )
        sub.add_argument("--p_main", type=PositiveInt, default=1000, help="p of the k sweep, coherence and concepts")
        sub.add_argument(
            "--max_steps",
            type=PositiveInt,
            default=None,
            help="optimiser steps per run (default: the config's own epochs)",
        )
        sub.add_argument(
            "--k_infer",
            nargs="+",
            type=PositiveInt,
            default=[1, 2, 5, 10, 20, 40, 80, 160],
            help="inference-time k values of the inference sweep",
        )
        sub.add_argument("--r_max", type=PositiveInt, default=64, help="largest r of the Babel curves")
        sub.add_argument(
            "--jobs",
            type=PositiveInt,
            default=1,
            help="training runs side by side (subprocesses when > 1; default 1: in-process)",
        )
        sub.add_argument(
            "--group_runs",
            type=bool,
            default=True,
            help="train the runs that share data and steps as one group (one pass over the data for all; "
            "each run as it would train alone); false: one fit per run",
        )
        sub.add_argument(
            "--sae_seeds",
            type=PositiveInt,
            default=3,
            help="SAEs trained per variant and setting, seeds 0..N-1 (in a group fit they train in the same pass); "
            "variants are compared over these seeds (Welch), never over probing draws (1: no comparison)",
        )
        sub.add_argument("--config_dir", default=None, help="folder of <variant>_<suffix>.yaml (default: configs/)")
        sub.add_argument(
            "--config_suffix",
            default=None,
            help="config suffix (default: digits for digits, mnist for "
            "mnist/mnist_sample, "
            "else the shard manifest's backbone)",
        )
        sub.add_argument("--data_dpath", default=None, help="folder holding MNIST/raw for --data mnist")
        sub.add_argument(
            "--eval_tokens",
            type=PositiveInt,
            default=None,
            help="cap on validation tokens evaluated (default: the whole split, as val/r2 in training)",
        )
        sub.add_argument("--concept_tokens", type=PositiveInt, default=65536, help="inputs for concept statistics")
        sub.add_argument(
            "--example_index", type=int, default=0, help="validation input of the sequential reconstruction"
        )
        if name == "probing":
            sub.add_argument(
                "--probe_k",
                nargs="+",
                type=PositiveInt,
                default=[1, 2, 5, 20],
                help="numbers of latents (and of raw dimensions) each probe may use",
            )
            sub.add_argument(
                "--seeds",
                type=PositiveInt,
                default=5,
                help="draws of the balanced probing tasks per SAE (re-balancing draws, not SAE seeds): each "
                "SAE's figure is their mean, their spread reported as Monte-Carlo error, never as a difference "
                "between variants (those are over --sae_seeds)",
            )
    report = add("report", "rebuild OUT/report.md from OUT/results.json")
    report.add_argument("--out", required=True, help="a study's output folder")
    dictionary = add("dictionary", "concept figures and Babel of an external MP-SAE (.npz)")
    dictionary.add_argument(
        "--npz",
        required=True,
        help=".npz with W_dec [p, d] and b_pre [d]; 'authors' for the paper authors' MNIST MP-SAE (shipped)",
    )
    dictionary.add_argument("--out", required=True, help="output folder: figures, results.json, report.md")
    dictionary.add_argument(
        "--data",
        default="digits28",
        help="digits28 (default: the bundled digits resampled "
        "to 28x28, a stand-in, not MNIST), mnist_sample (5000 real MNIST digits, extra 'mnist'), "
        "mnist (MNIST/raw under --data_dpath) or none",
    )
    dictionary.add_argument("--k", type=PositiveInt, default=10, help="MP steps (the authors trained at k = 10)")
    dictionary.add_argument(
        "--k_infer", nargs="+", type=PositiveInt, default=[1, 2, 5, 10, 20, 40, 80], help="inference-time k values"
    )
    dictionary.add_argument("--r_max", type=PositiveInt, default=64, help="largest r of the Babel curves")
    dictionary.add_argument("--max_tokens", type=PositiveInt, default=None, help="cap on inputs (default: all)")
    dictionary.add_argument("--example_index", type=int, default=0, help="input of the sequential reconstruction")
    dictionary.add_argument("--data_dpath", default="data", help="folder holding MNIST/raw for --data mnist")
    one = add("sae", "R², L0, Babel of one SAE directory: an export or a SAELens SAE")
    one.add_argument(
        "--sae",
        required=True,
        help="export (config.json + sae.safetensors) or SAELens directory (cfg.json + sae_weights.safetensors)",
    )
    one.add_argument("--out", required=True, help="output folder: results.json (saes.<DIR name>), figures")
    one.add_argument(
        "--data",
        default="digits",
        help="the SAE's data: digits, mnist_sample, mnist, a shard directory "
        "or an .h5 "
        "token cache; evaluated on its validation split",
    )
    one.add_argument(
        "--val_fraction",
        type=float,
        default=0.1,
        help="held-out share, as in training's --data.val_fraction (the same rows)",
    )
    one.add_argument(
        "--k_infer",
        nargs="+",
        type=PositiveInt,
        default=None,
        help="inference-time k values (default: powers of two around the trained k)",
    )
    one.add_argument("--r_max", type=PositiveInt, default=64, help="largest r of the Babel curves")
    one.add_argument(
        "--max_tokens", type=PositiveInt, default=None, help="cap on validation tokens (default: the whole split)"
    )
    one.add_argument("--data_dpath", default="data", help="folder holding MNIST/raw for --data mnist")
    causal = add("causal", "each atom's effect on a linear probe and on the error when zeroed in the reconstruction")
    causal.add_argument("--sae", required=True, help="export or SAELens directory (as for the sae subcommand)")
    causal.add_argument("--out", required=True, help="output folder: causal.json, causal.md")
    causal.add_argument(
        "--data",
        default="digits",
        help="labelled data the SAE was trained on: digits, mnist_sample, mnist or a shard directory whose "
        "meta.json carries 'label'; probe fitted on the training split, effects measured on the validation split",
    )
    causal.add_argument("--atoms", nargs="+", type=int, default=None, help="atoms to report (default: all)")
    causal.add_argument("--val_fraction", type=float, default=0.1, help="held-out share, as in training's")
    causal.add_argument("--data_dpath", default="data", help="folder holding MNIST/raw for --data mnist")
    causal.add_argument(
        "--set_size",
        type=PositiveInt,
        default=10,
        help="atoms per class removed together in the set ablations (SAEBench's TPP)",
    )
    intervene = add(
        "intervene",
        "atoms removed or scaled in the backbone's own layer (error term kept), the rest of the vision model run, "
        "its output's change per image",
    )
    intervene.add_argument(
        "--sae", required=True, help="export or SAELens directory of an SAE trained on shards of a backbone"
    )
    intervene.add_argument("--images", nargs="+", required=True, help="image files, folders of images, or samples")
    intervene.add_argument("--atoms", nargs="+", type=int, required=True, help="atoms to remove or scale")
    intervene.add_argument("--scale", type=float, default=0.0, help="factor on the atoms' codes (0: removed)")
    intervene.add_argument("--out", required=True, help="output folder: intervene.json, intervene.md")
    intervene.add_argument(
        "--checkpoint_path", default=None, help="the backbone's weights file, when the recorded one has moved"
    )
    intervene.add_argument("--batch_size", type=PositiveInt, default=8, help="images per forward pass")
    intervene.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1")
    return parser
