"""Part 7 (``stages``): the features pass's CPU per batch, stage by stage, on the same synthetic codes.

    python -m benchmarks.features --parts stages --d_sae 19200        # this tree
    PYTHONPATH=. python PATH_TO_THIS_FILE                             # from an older checkout's root: its pass

Why apart from the throughput part: on a shared box the pass's tokens/s moves by ±15 % between runs of one
commit, more than the few per cent a change to one stage costs; CPU seconds per stage, the same batches on both
sides, show it. Run as a file it measures whatever `sae_pipeline` comes first on the path (an older checkout's:
its `LabelCounts.update` without the codes' values is called as it was).
"""

from __future__ import annotations

import argparse
import inspect
import time

STAGES = ("encode", "top-N table", "label statistics", "distribution")


def stage_seconds(
    d: int, d_sae: int, k: int, batch_size: int, batches: int, top: int = 16
) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds per batch of each stage of `FeaturesModule.predict_step`, TopK SAE, random tokens (seeded): over
    every batch, and over the second half only (the steady state: early in a pass most entries still enter the
    samples of the top-N table and of the distribution, later few do, and a real pass has thousands of batches)."""
    import torch

    from benchmarks.features.data import TPI, make_sae
    from sae_pipeline.features.distribution import DistributionTable
    from sae_pipeline.features.labels import LabelCounts
    from sae_pipeline.features.topn import TopNTable

    sae = make_sae(d, d_sae, k)
    table, counts, distribution = TopNTable(d_sae, top), LabelCounts(d_sae, TPI), DistributionTable(d_sae)
    with_values = "values" in inspect.signature(LabelCounts.update).parameters  # older passes counted only
    seconds = dict.fromkeys(STAGES, 0.0)
    first_half: dict[str, float] = {}
    generator = torch.Generator().manual_seed(1)

    def timed(stage: str, fn, *args):  # noqa: ANN001, ANN202
        start = time.process_time()
        out = fn(*args)
        seconds[stage] += time.process_time() - start
        return out

    with torch.no_grad():
        for b in range(batches):
            if b == batches // 2:
                first_half = dict(seconds)
            x = torch.randn(batch_size, d, generator=generator)
            token = torch.arange(b * batch_size, (b + 1) * batch_size)
            image, position = token // TPI, token % TPI
            codes = timed("encode", sae.encode_sparse, x)
            entries = (codes.rows, codes.indices, codes.values)
            timed("distribution", distribution.update, *entries, token, image, position)
            rows, atoms = timed("top-N table", table.update_entries, *entries, codes.batch_size, token, image, position)
            values = (codes.values,) if with_values else ()
            timed("label statistics", counts.update, rows, atoms, *values, image, image % 1000)
    late = batches - batches // 2
    return (
        {stage: value / batches for stage, value in seconds.items()},
        {stage: (value - first_half.get(stage, 0.0)) / late for stage, value in seconds.items()},
    )


def stages(args: argparse.Namespace, work: object = None) -> None:
    """Print the per-batch CPU of each stage (see the module docstring)."""
    import torch

    every, late = stage_seconds(args.d, args.d_sae, args.k, args.batch_size, args.stage_batches)
    print(
        f"7. the pass's CPU per batch by stage: {args.stage_batches} batches of {args.batch_size} random tokens, "
        f"d {args.d}, TopK d_sae {args.d_sae} k {args.k}, 1000 labels, torch threads {torch.get_num_threads()}"
    )
    for name, per_batch in (("every batch", every), ("second half", late)):
        stages_text = ", ".join(f"{stage} {1000 * value:.0f} ms" for stage, value in per_batch.items())
        total, encode = 1000 * sum(per_batch.values()), 1000 * per_batch["encode"]
        print(f"   {name:<12}: {stages_text}; all {total:.0f} ms, all but encode {total - encode:.0f} ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage_batches", type=int, default=60, help="stages part: batches timed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the features pass's CPU per batch, stage by stage")
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--d_sae", type=int, default=19_200)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=4096)
    add_arguments(parser)
    stages(parser.parse_args())
