"""The demo's report: each run's final metrics, read back from the TensorBoard event files it wrote, as one table.

`val/r2`, `val/l0` and the Babel scalars (dictionary μ₁(1) and μ₁(k), co-active μ₁(k)) of the last validation,
one row per run, then what the numbers mean: the paper's claims for the digits variants, a smoke test for the
photo-shard run. Apart from the stages (`sae_pipeline.demo_stages`) that write the runs.
"""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

SHARDS_LABEL = "TopK (photo shards)"
FINAL_TAGS = ("val/r2", "val/l0", "val/babel_dict_r1", "val/babel_dict_rk", "val/babel_coactive_rk")


def read_final_metrics(log_dpath: Path, tags: tuple[str, ...] = FINAL_TAGS) -> dict[str, tuple[int, float]]:
    """``{tag: (step, value)}`` of the last event of each scalar ``tag`` in a TensorBoard run folder."""
    accumulator = EventAccumulator(str(log_dpath), size_guidance={"scalars": 0, "images": 1, "histograms": 1})
    accumulator.Reload()
    available = set(accumulator.Tags()["scalars"])
    missing = [tag for tag in tags if tag not in available]
    if missing:
        raise ValueError(f"{log_dpath}: no scalar {', '.join(missing)} in the event files (has {sorted(available)})")
    return {tag: (accumulator.Scalars(tag)[-1].step, accumulator.Scalars(tag)[-1].value) for tag in tags}


def last_run_metrics(run_dpath: Path) -> dict[str, tuple[int, float]]:
    """The final metrics (as `read_final_metrics`) of the newest `version_N` of a run."""
    versions = sorted(run_dpath.glob("version_*"))
    if not versions:
        raise FileNotFoundError(f"no TensorBoard run folder under {run_dpath}")
    return read_final_metrics(versions[-1])


def format_table(rows: list[tuple[str, dict[str, tuple[int, float]]]]) -> str:
    """Variant, val R², L0 and Babel μ₁ of the dictionary (r = 1, r = k) and of the co-active atoms (r = k)."""
    columns = [
        ("val R²", "val/r2", 7, 3),
        ("L0", "val/l0", 6, 2),
        ("dict μ₁(1)", "val/babel_dict_r1", 11, 3),
        ("dict μ₁(k)", "val/babel_dict_rk", 11, 3),
        ("co-active μ₁(k)", "val/babel_coactive_rk", 16, 3),
    ]
    label_width = max([10] + [len(label) + 1 for label, _ in rows])
    header = f"{'variant':<{label_width}}" + "".join(f" {title:>{width}}" for title, _, width, _ in columns)
    lines = [header, "-" * len(header)]
    for label, metrics in rows:
        cells = "".join(f" {metrics[tag][1]:>{width}.{digits}f}" for _, tag, width, digits in columns if tag in metrics)
        lines.append(f"{label:<{label_width}}{cells}")
    return "\n".join(lines)


def final_rows(
    runs_dpath: Path, variants: list[str], labels: dict[str, str], with_shards: bool
) -> list[tuple[str, dict[str, tuple[int, float]]]]:
    """The table's rows: each digits variant's final metrics, then the photo-shard run's (when it trained)."""
    rows = [(labels[variant], last_run_metrics(runs_dpath / f"{variant}_digits")) for variant in variants]
    if with_shards:
        rows.append((SHARDS_LABEL, last_run_metrics(runs_dpath / "demo_shards")))
    return rows


def print_results(
    rows: list[tuple[str, dict[str, tuple[int, float]]]], digits: bool, shards_dpath: Path | None
) -> None:
    """The table, then what it shows: the paper's claims (`digits`: digits variants trained) and what the
    photo-shard run is (`shards_dpath`: where its shards are, None when it did not train)."""
    step = rows[0][1]["val/r2"][0]
    print(f"\nFinal validation metrics (held-out data, logged at step {step}; Babel μ₁(r), r = 1 or k):")
    print(format_table(rows))
    if digits:
        print(
            "\nThe paper's claims (Costa et al. 2025): at equal k MP-SAE reaches the higher R², and it learns a "
            "more coherent\ndictionary (higher dictionary Babel) yet picks less coherent atoms per token (lower "
            "co-active Babel).\nThis run is short (240 steps on 8x8 digits, not MNIST): compare the whole curves "
            "in the val/babel figures."
        )
    if shards_dpath is not None:
        print(
            f"{SHARDS_LABEL}: trained on the photo shards in {shards_dpath} (14 photos x 17 tokens of a "
            "random tiny ViT; d_sae = 256, k = 8,\nheld-out shard): a check that the pipeline runs end to end, "
            "not a result."
        )
