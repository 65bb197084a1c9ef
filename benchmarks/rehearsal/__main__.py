"""Rehearsal at 1/50 of ImageNet: every stage of the pipeline on DINOv2-shaped shards, timed, with a kill -9.

    python -m benchmarks.rehearsal --out DIR                 # 25 000 images x 261 tokens x 768 (~10 GB)
    python -m benchmarks.rehearsal --out DIR --images 2000   # a smaller run (the table in BENCHMARKS.md)
    python -m benchmarks.rehearsal --out DIR --quick         # 40 images x 261 x 64 (tests/test_benchmarks_rehearsal.py)

Why: the pieces are tested and benchmarked apart; this runs them end to end at a size where disk,
memory and time start to matter, and says what the full ImageNet-1k run (x50: 1.28 M images, 334 M
tokens, ~514 GB of float16 shards) would take. Each stage is a real process (``python -m ...``),
timed by wall clock, its peak RSS taken from ``os.wait4`` (the process and the children it reaped:
DataLoader workers included) and its disk as the bytes under its output folder:

1. ``shards``: synthetic tokens (``benchmarks/rehearsal/shards.py``) through the shard writer.
2. ``fit``: a group of one TopK and one MP-SAE (``model.members``), one epoch. The run is held at
   half-way through the epoch, after its second periodic checkpoint (``--checkpoint.every_n_train_steps``),
   and killed with SIGKILL (no handler runs); ``fit --ckpt_path last`` then finishes the epoch.
   ``benchmarks/rehearsal/audit.py`` records every batch's tokens in both processes and checks the
   stitched epoch: every step once, the replayed batches equal to those the kill lost, no token
   repeated, none from outside the training split, fewer than one batch of it left out.
3. ``features``: the feature browser of each member (``--name``) on the first ``--part_shards`` shards
   (a copy-free part: hard links and its own manifest); the pass is linear in tokens, the site is not.
4. ``export`` of both members, then ``evaluate sae`` of each on the validation split.
   (``--quick`` runs 3 and 4's per-member stages for the MP-SAE member only.)
5. ``predict``: the MP-SAE member's codes of the same first ``--part_shards`` shards.

Prints a markdown table (and ``DIR/rehearsal.json``) with each stage projected to the full size:
linear in tokens (every stage streams its tokens; export and evaluate's Babel do not grow).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path

from benchmarks.rehearsal.audit import AUDIT_ENV, HOLD_ENV
from benchmarks.scaling.fit import run_measured

REPO_DPATH = Path(__file__).resolve().parents[2]  # the children run `python -m ...` from here
FULL_IMAGES = 1_281_167  # ImageNet-1k train
MEMBERS = ("topk", "mpsae")
FIT_ENV = (AUDIT_ENV, HOLD_ENV)


def sizes(args: argparse.Namespace) -> dict:
    """The run's sizes: ``--quick``'s tiny ones or the rehearsal's (planned: 40 minutes, 2 quiet cores)."""
    if args.quick:
        base = {"images": 40, "d": 64, "shard_size": 2, "batch_size": 256, "d_sae": 128, "k": 4, "workers": 0, "top": 2}
    else:
        base = {"images": args.images, "d": 768, "shard_size": 1000, "batch_size": 4096, "d_sae": 256, "k": 8}
        base["workers"], base["top"] = 1, 16
        base["shard_size"] = min(1000, max(1, math.ceil(args.images / 20)))  # >= 20 shards: 1 for validation
    for key in ("d_sae", "k", "batch_size"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    return base


def disk_bytes(*dpaths: Path) -> int:
    return sum(f.stat().st_size for d in dpaths if d.exists() for f in d.rglob("*") if f.is_file())


def run_stage(argv: list[str], env: dict | None = None, hold: Path | None = None) -> dict:
    """Run ``python ARGV`` from the repository through ``benchmarks.scaling.fit.run_measured`` (its launcher
    keeps the driver's RSS out of the stage's peak); with ``hold``, SIGKILL it once that file appears.
    Returns wall seconds, CPU seconds and peak RSS (MiB) from ``wait4`` (the stage and the children it reaped:
    workers, writers), the exit code and the log (stdout and stderr); raises on an unexpected failure."""
    run = run_measured(
        [sys.executable, *argv],
        cwd=REPO_DPATH,
        env=env,
        timeout=None,
        hold=hold,
        expect_status=-signal.SIGKILL if hold is not None else 0,
        merge_stderr=True,
    )
    return {
        "wall_s": run["wall_s"],
        "cpu_s": run["cpu_s"],
        "peak_rss_mib": run["peak_rss_mib"],
        "exit": run["status"],
        "log": run["stdout"],
    }


def write_config(out: Path, size: dict, val_fraction: float, every: int) -> Path:
    members = {
        "topk": {"class_path": "sae_pipeline.sae.TopKSAE"},
        "mpsae": {"class_path": "sae_pipeline.sae.MatchingPursuitSAE"},
    }
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "precision": "32-true",
            "max_epochs": 1,
            "log_every_n_steps": max(1, every // 4),
            "num_sanity_val_steps": 0,
            "default_root_dir": str(out / "runs"),
            "enable_progress_bar": False,
            "callbacks": [{"class_path": "benchmarks.rehearsal.audit.BatchAudit"}],
        },
        "checkpoint": {"every_n_train_steps": every},
        "model": {
            "members": {
                name: {
                    "sae": {**sae, "init_args": {"d_sae": size["d_sae"], "k": size["k"]}},
                    "lr": 5.0e-4,
                    "warmup_steps": max(1, every // 2),
                }
                for name, sae in members.items()
            }
        },
        "data": {
            "source": str(out / "shards"),
            "batch_size": size["batch_size"],
            "num_workers": size["workers"],
            "shuffle_buffer_tokens": 16 * size["batch_size"],
            "val_fraction": val_fraction,
            "eval_tokens": min(16_384, 4 * size["batch_size"]),
        },
    }
    fpath = out / "rehearsal.yaml"  # JSON is YAML
    fpath.write_text(json.dumps(config, indent=1) + "\n")
    return fpath


def checkpoint_step(fpath: Path) -> int:
    from sae_pipeline.artifacts.checkpoint import read_checkpoint

    return int(read_checkpoint(fpath)["global_step"])


def part_of_shards(out: Path, n: int) -> Path:
    """The first ``n`` shards as a shard folder of their own (hard links, its own manifest)."""
    from feature_extraction import shards as S

    src, part = out / "shards", out / "shards_part"
    manifest = json.loads((src / S.MANIFEST_FNAME).read_text())
    for i in range(n):
        for name in (S.shard_fname(i), S.sidecar_fname(i)):
            (part / name).parent.mkdir(parents=True, exist_ok=True)
            os.link(src / name, part / name)
    S.write_manifest(
        part,
        n_shards=n,
        spec=manifest["backbone"],
        layer=manifest["layer"],
        tokens_per_image=manifest["tokens_per_image"],
        n_prefix_tokens=manifest["n_prefix_tokens"],
        grid=manifest["grid"],
        extra=manifest["extra"],
    )
    return part


def rehearse(args: argparse.Namespace) -> dict:
    from benchmarks.rehearsal.audit import check_resume
    from benchmarks.rehearsal.shards import train_hashes

    out, size = Path(args.out).resolve(), sizes(args)
    rows: list[dict] = []

    def row(stage: str, result: dict, *dpaths: Path, scales: bool | str = True, note: str = "") -> None:
        logs = out / "logs"
        logs.mkdir(exist_ok=True)
        (logs / ("".join(c if c.isalnum() else "_" for c in stage) + ".log")).write_text(result["log"])
        rows.append(
            {
                "stage": stage,
                "wall_s": result["wall_s"],
                "cpu_s": result["cpu_s"],
                "peak_rss_mib": result["peak_rss_mib"],
                "disk_bytes": disk_bytes(*dpaths),
                "scales": scales,
                "note": note,
            }
        )
        print(f"{stage}: {result['wall_s']:.1f} s, {result['peak_rss_mib']:.0f} MiB", flush=True)

    shards_argv = ["-m", "benchmarks.rehearsal.shards", "--out", str(out), "--images", str(size["images"])]
    shards_argv += ["--d", str(size["d"]), "--shard_size", str(size["shard_size"])]
    row("shards", run_stage(shards_argv), out / "shards", out / "hashes", note="+ audit hashes")
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    n_shards = len(manifest["shards"])
    val_fraction = 1 / n_shards  # one shard held out
    train = train_hashes(out, val_fraction)
    n_batches = len(train) // size["batch_size"]
    every = max(1, n_batches // 5)
    hold_at = 2 * every + max(1, every // 2)  # held (then killed) half-way between two checkpoints
    config = write_config(out, size, val_fraction, every)

    audit = out / "audit"
    audit.mkdir()
    env = {FIT_ENV[0]: str(audit / "killed.bin"), FIT_ENV[1]: f"{hold_at}:{audit / 'held'}"}
    fit = ["-m", "sae_pipeline", "fit", "--config", str(config)]
    killed = run_stage(fit, env, hold=audit / "held")
    row("fit, killed (kill -9)", killed, out / "runs", note=f"held at step {hold_at} of {n_batches}, then SIGKILL")
    ckpts = sorted((out / "runs").rglob("last.ckpt"))
    ckpt_step = checkpoint_step(ckpts[-1])
    before = disk_bytes(out / "runs")
    resumed = run_stage([*fit, "--ckpt_path", "last"], {FIT_ENV[0]: str(audit / "resumed.bin")})
    resumed_disk = disk_bytes(out / "runs") - before
    row("fit, resumed (--ckpt_path last)", resumed, note=f"from step {ckpt_step} to {n_batches}")
    rows[-1]["disk_bytes"] = resumed_disk  # what the resumed run added under runs/
    final = max((out / "runs").rglob("last.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    count = check_resume(audit / "killed.bin", audit / "resumed.bin", ckpt_step, n_batches, size["batch_size"], train)
    count["final_global_step"] = checkpoint_step(final)
    if count["final_global_step"] != n_batches:
        count["failures"].append(f"final global step {count['final_global_step']} != {n_batches}")

    n_part = min(n_shards, args.part_shards)
    part = part_of_shards(out, n_part)
    studied = ("mpsae",) if args.quick else MEMBERS  # --quick: one member's features and evaluation (fewer processes)
    for name in studied:
        argv = ["-m", "sae_pipeline", "features", "--config", str(config), "--ckpt_path", str(final)]
        argv += ["--data.source", str(part), "--name", name, "--top", str(size["top"])]
        argv += ["--out", str(out / "features" / name)]
        note = f"{n_part} of {n_shards} shards; the site part does not grow with tokens: projection is an upper bound"
        row(f"features {name}", run_stage(argv), out / "features" / name, scales="at most", note=note)
        rows[-1]["tokens_fraction"] = n_part / n_shards
    argv = ["-m", "sae_pipeline", "export", "--ckpt_path", str(final), "--out", str(out / "export")]
    row("export", run_stage(argv), out / "export", scales=False, note="both members")
    for name in studied:
        argv = [
            "-m",
            "sae_pipeline.evaluate",
            "sae",
            "--sae",
            str(out / "export" / name),
            "--data",
            str(out / "shards"),
        ]
        argv += ["--val_fraction", str(val_fraction), "--out", str(out / "eval" / name)]
        row(f"evaluate sae {name}", run_stage(argv), out / "eval" / name, note="validation shard")
    argv = ["-m", "sae_pipeline", "predict", "--config", str(config), "--ckpt_path", str(final)]
    argv += [
        "--model.predict_member",
        "mpsae",
        "--data.source",
        str(part),
        "--codes.fpath",
        str(out / "predict" / "codes.h5"),
    ]
    row("predict mpsae", run_stage(argv), out / "predict", note=f"{n_part} of {n_shards} shards")
    rows[-1]["tokens_fraction"] = n_part / n_shards

    results = {
        "size": size,
        "tokens": manifest["n_tokens"],
        "n_shards": n_shards,
        "n_batches": n_batches,
        "resume": count,
        "rows": rows,
        "r2": {name: _r2(out / "eval" / name) for name in studied},
    }
    (out / "rehearsal.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def _r2(dpath: Path) -> float | None:
    try:
        saes = json.loads((dpath / "results.json").read_text())["saes"]
        return float(next(iter(saes.values()))["r2"])
    except (OSError, KeyError, StopIteration, ValueError, TypeError):
        return None


def table(results: dict) -> str:
    """The markdown table: each stage here and projected linearly to ImageNet-1k (x full / this tokens)."""
    factor = FULL_IMAGES / results["size"]["images"]
    lines = [
        f"| stage | wall | CPU | peak RSS | disk | x{factor:.0f} (ImageNet-1k): wall, disk | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    total = full_total = cpu = 0.0
    for r in results["rows"]:
        scale = factor / r.get("tokens_fraction", 1.0) if r["scales"] else 1.0
        bound = "≤ " if r["scales"] == "at most" else ""
        disk_scale = 1.0 if r["scales"] == "at most" else scale  # a site's size is atoms x top images, not tokens
        total += r["wall_s"]
        cpu += r["cpu_s"]
        full_total += r["wall_s"] * scale
        lines.append(
            f"| {r['stage']} | {_duration(r['wall_s'])} | {_duration(r['cpu_s'])} | {r['peak_rss_mib']:.0f} MiB "
            f"| {_bytes(r['disk_bytes'])} "
            f"| {bound}{_duration(r['wall_s'] * scale)}, {_bytes(r['disk_bytes'] * disk_scale)} | {r['note']} |"
        )
    lines.append(f"| **total** | {_duration(total)} | {_duration(cpu)} | | | {_duration(full_total)} | |")
    return "\n".join(lines)


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="a new or empty folder (~0.4 MB per image at d 768)")
    parser.add_argument("--images", type=int, default=25_000)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--d_sae", type=int)
    parser.add_argument("--k", type=int)
    parser.add_argument("--batch_size", type=int)
    parser.add_argument(
        "--part_shards", type=int, default=2, help="shards `features` and `predict` read (projected to all)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        sys.exit(f"error: --out {out} exists and is not an empty folder; pass a new one")
    if args.images < 20 and not args.quick:
        sys.exit(f"error: --images {args.images} is too few for 20 shards; pass --images 20 or more")
    out.mkdir(parents=True, exist_ok=True)
    results = rehearse(args)
    print()
    print(table(results))
    count = results["resume"]
    print(
        f"\nresume: killed at step {count['killed_run_batches'] - 1}, checkpoint at {count['checkpoint_step']}, "
        f"{count['redone_after_kill']} batches redone; epoch {count['epoch_batches']} of {count['expected_batches']} "
        f"batches, {count['tokens_trained']} of {count['train_tokens']} training tokens "
        f"({count['tokens_left_out']} left out, {count['tokens_repeated']} repeated, "
        f"{count['tokens_foreign']} foreign), "
        f"replay equal: {count['replay_equal']}; val R² {results['r2']}"
    )
    if count["failures"]:
        print("RESUME CHECK FAILED: " + "; ".join(count["failures"]), file=sys.stderr)
        sys.exit(1)
    print("resume check: passed")


if __name__ == "__main__":
    main()
