"""Benchmark: the feature browser's pass against a bare ``predict`` pass, its memory, and the site's cost.

    python -m benchmarks.features                    # every part (CPU sizes below)
    python -m benchmarks.features --device cuda      # parts 1 and 2 on a GPU
    python -m benchmarks.features --quick            # tiny sizes (a smoke run)
    python -m benchmarks.features --parts explain    # features explain of one image
    python -m benchmarks.features --parts run_shares # issue 24: label statistics + image pages in one whole run

1. Throughput, same run, same data: synthetic shards in DINOv2's token layout (CLS + 4
   registers + 16x16 patches = 261 tokens per image), a TopK SAE, both sides through
   ``trainer.predict`` over ``ActivationDataModule``'s predict loader. "bare predict" is
   ``SAEModule.predict_step`` (encode + sparse codes, nothing kept or written); "features pass"
   is :class:`FeaturesModule` (encode + the exact top-N table + statistics) timed to the end of
   its streaming pass; "features all" adds the end of the run (rank merge and the re-read of
   the top images' tokens for the heatmaps). Sides alternate for ``--repeats`` rounds; the
   median tokens/s of each is compared (target: features pass >= 0.7 x bare predict).
2. Peak memory against the token count: the features pass over N and 4N tokens, each in a
   fresh process; peak RSS (CPU) or ``torch.cuda.max_memory_allocated`` (GPU). Flat means the
   4N/N ratio stays near 1 (the table is d_sae x N_top; no [tokens, d_sae] buffer).
3. The site for d_sae = 19 200, N = 16 (synthetic table and images): build time and size,
   without and with label statistics (``--site_labels`` labels, ImageNet's 1000 by default:
   atom sections, index columns and scatter, one page per label), each built from scratch.
3c. (``site_shares``) One labelled site of that size with image pages: the label statistics
   (``label_stats``, the atom sections with their label bars, index cells, headers, section and
   scatter data, the label pages) and the image pages (each image's top atoms ranked from
   synthetic sparse codes, as ``collect_images`` does, and ``write_site_image_pages``) timed
   inside the one build, wall and CPU, as shares of the build without them.
3d. (``run_shares``) The same shares in one whole ``features`` run in this process, pass and
   re-read included: synthetic shards of ``--site_images`` images (JPEG sources, 1000 labels),
   a TopK SAE of ``--site_d_sae`` atoms; the label counts in the pass (``LabelCounts.update``)
   join the label statistics. Shares of the whole run and of its site (``build_site`` plus the
   image rankings) without them; target: both together <= 25 %.
4. ``features explain`` of one image (a 256x256 JPEG) with ViT-B/16 (``vit``, random weights
   from a recorded seed: no download) and a TopK SAE (d_sae 6144): the whole command once (SAE,
   backbone build, one image, its page), then, with the backbone and SAE loaded, the cost of one
   image (forward, SAE encode, top atoms, page) against a bare backbone forward + SAE encode of
   the same image in the same run (median of ``--repeats`` alternated rounds; target about 1).
5. The label counts' cost in the pass, measured apart: ``LabelCounts.update`` against the
   top-N table's update on the same codes, and the shard read with and without ``meta.json``.
6. (``sparse``) The pass's updates and the image rankings from the SAE's sparse codes against the
   former dense ``[B, d_sae]`` path, same batches, outputs checked equal (``benchmarks/features/sparse.py``).
7. (``stages``) The pass's CPU per batch, stage by stage (``benchmarks/features/stages.py``; runs against an
   older checkout too).

Parts 3, 3c and 3d (the site) are in ``benchmarks/features/site.py``, the synthetic data all parts use
in ``benchmarks/features/data.py``; this module holds the driver and the pass parts.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from benchmarks.features.data import TPI, make_sae, write_synthetic_shards
from benchmarks.features.stages import add_arguments as add_stage_arguments
from benchmarks.scaling.fit import run_measured

warnings.filterwarnings("ignore")
REPO_DPATH = Path(__file__).resolve().parents[2]  # the children run `python -m benchmarks.features` from here


def timed_predict(side: str, shards: Path, sae, batch_size: int, device: str, top: int) -> dict:  # noqa: ANN001
    """One pass of ``side`` ("bare" or "features"); returns tokens and seconds (pass, and whole run)."""
    import lightning as L
    import torch

    from sae_pipeline.data import ActivationDataModule
    from sae_pipeline.features.heatmaps import layout_of
    from sae_pipeline.features.pass_module import FeaturesModule
    from sae_pipeline.training.module import SAEModule

    dm = ActivationDataModule(
        str(shards), batch_size=batch_size, num_workers=2, shuffle_buffer_tokens=batch_size, val_fraction=0.0
    )
    marks: dict[str, float] = {}

    class Bare(SAEModule):
        def on_predict_start(self) -> None:
            self.trainer.predict_loop.return_predictions = False

        def predict_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            super().predict_step(batch, batch_idx)

    class Features(FeaturesModule):
        def on_predict_end(self) -> None:
            if device == "cuda":
                torch.cuda.synchronize()
            marks["pass_end"] = time.perf_counter()
            super().on_predict_end()

    module = Bare(sae) if side == "bare" else Features(sae, top, layout_of(dm.data_source))
    if side == "bare":
        module.initialized_from_data.fill_(True)  # raw units, like the features side
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.predict(module, datamodule=dm)
    if device == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    n_tokens = dm.data_source.manifest["n_tokens"]
    return {"tokens": n_tokens, "seconds": marks.get("pass_end", end) - start, "seconds_all": end - start}


def throughput(args: argparse.Namespace, work: Path) -> None:
    shards = work / "throughput"
    write_synthetic_shards(shards, args.images, args.d)
    sae = make_sae(args.d, args.d_sae, args.k)
    print(
        f"1. throughput: {args.images} images x {TPI} tokens = {args.images * TPI} tokens, d {args.d}, TopK d_sae "
        f"{args.d_sae} k {args.k}, batch {args.batch_size}, top {args.top}, device {args.device}"
    )
    rates: dict[str, list[float]] = {"bare predict": [], "features pass": [], "features all": []}
    timed_predict("features", shards, sae, args.batch_size, args.device, args.top)  # warm-up (caches, threads)
    for round_index in range(args.repeats):
        bare = timed_predict("bare", shards, sae, args.batch_size, args.device, args.top)
        feat = timed_predict("features", shards, sae, args.batch_size, args.device, args.top)
        rates["bare predict"].append(bare["tokens"] / bare["seconds"])
        rates["features pass"].append(feat["tokens"] / feat["seconds"])
        rates["features all"].append(feat["tokens"] / feat["seconds_all"])
        print(
            f"   round {round_index + 1}: bare {rates['bare predict'][-1]:,.0f} tok/s, features pass "
            f"{rates['features pass'][-1]:,.0f} tok/s, with end of run {rates['features all'][-1]:,.0f} tok/s"
        )
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, value in medians.items():
        print(f"   {name:<14} {value:>12,.0f} tokens/s (median)")
    ratio = medians["features pass"] / medians["bare predict"]
    print(
        f"   features pass / bare predict = {ratio:.2f} (target >= 0.7); with the end of the run: "
        f"{medians['features all'] / medians['bare predict']:.2f}"
    )


def memory_child(shards: str, d: int, d_sae: int, k: int, batch_size: int, device: str, top: int) -> None:
    import torch

    result = timed_predict("features", Path(shards), make_sae(d, d_sae, k), batch_size, device, top)
    if device == "cuda":
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
    else:
        result["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result))


def memory(args: argparse.Namespace, work: Path) -> None:
    measured = "GPU allocated" if args.device == "cuda" else "RSS"
    print(f"2. peak memory of the features pass (fresh process each; {measured})")
    peaks = []
    for factor in (1, 4):
        shards = work / f"memory{factor}"
        write_synthetic_shards(shards, args.memory_images * factor, args.d, seed=factor)
        command = [
            sys.executable,
            "-m",
            "benchmarks.features",
            "--memory-child",
            str(shards),
            "--d",
            str(args.d),
            "--d_sae",
            str(args.d_sae),
            "--k",
            str(args.k),
            "--batch_size",
            str(args.batch_size),
            "--device",
            args.device,
            "--top",
            str(args.top),
        ]
        # From a small launcher: a child forked straight from this driver would start its ru_maxrss at the
        # driver's RSS (Linux carries it across fork + exec) and hide the growth this part measures.
        out = run_measured(command, cwd=REPO_DPATH, timeout=None)["stdout"]
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        peaks.append(result["peak_bytes"])
        print(f"   {result['tokens']:>10,} tokens: peak {result['peak_bytes'] / 2**20:,.0f} MiB")
    print(f"   4x tokens / 1x tokens peak = {peaks[1] / peaks[0]:.3f}")


def label_cost(args: argparse.Namespace, work: Path) -> None:
    """The label counts' share of the pass, measured apart (the pass's tokens/s on a shared box is too noisy to
    show a few per cent): per batch, ``LabelCounts.update`` beside ``TopNTable.update_codes`` on the same codes,
    and the shard read with and without ``meta.json``; CPU seconds, sides alternated."""
    import torch

    from feature_extraction.shards import shard_fpaths
    from feature_extraction.shards.read import iter_shard_tokens
    from sae_pipeline.data.sources import ShardSource
    from sae_pipeline.features.labels import LabelCounts
    from sae_pipeline.features.topn import TopNTable

    shards = work / "label_cost"
    write_synthetic_shards(shards, args.images, args.d)
    sae = make_sae(args.d, args.d_sae, args.k)
    source = ShardSource(shards)
    tokens = np.concatenate([c.tokens for u in source.units("all", 0.0) for c in u.read(0, u.n_tokens)])
    batches = []
    with torch.no_grad():
        for start in range(0, len(tokens), args.batch_size):
            x = torch.from_numpy(tokens[start : start + args.batch_size].astype(np.float32))
            token = torch.arange(start, start + len(x))
            batches.append((sae.encode(x), token, token // TPI, (token // TPI) % 1000))
    table, counts = TopNTable(args.d_sae, args.top), LabelCounts(args.d_sae, TPI)
    table_cpu = counts_cpu = 0.0
    for codes, token, image, label in batches:
        start = time.process_time()
        rows, atoms = table.update_codes(codes, token, image, token % TPI)
        values = codes[rows, atoms]  # the pass has them already (the sparse codes' values)
        middle = time.process_time()
        counts.update(rows, atoms, values, image, label)
        table_cpu, counts_cpu = table_cpu + middle - start, counts_cpu + time.process_time() - middle
    print(
        f"5. label counts in the pass: {len(tokens):,} tokens ({len(batches)} batches of {args.batch_size}), "
        f"TopK d_sae {args.d_sae} k {args.k}, {TPI} tokens per image, 1000 labels"
    )
    print(
        f"   top-N table {table_cpu:.2f} s CPU, label counts {counts_cpu:.2f} s CPU "
        f"(+{100 * counts_cpu / table_cpu:.0f} % of the table's update; encoding not included)"
    )
    reads = {False: [], True: []}
    fpaths = shard_fpaths(source.name, source.manifest)
    for _ in range(max(args.repeats, 1)):
        for with_meta in (False, True):
            start = time.process_time()
            for fpath in fpaths:
                for _ in iter_shard_tokens(fpath, with_positions=True, with_meta=with_meta):
                    pass
            reads[with_meta].append(time.process_time() - start)
    plain, meta = min(reads[False]), min(reads[True])
    print(
        f"   shard read {plain:.3f} s CPU, with meta.json {meta:.3f} s CPU (+{100 * (meta / plain - 1):.0f} %; "
        f"best of {max(args.repeats, 1)})"
    )


def explain(args: argparse.Namespace, work: Path) -> None:
    import json

    import torch
    from PIL import Image
    from safetensors.torch import save_file

    from feature_extraction.backbones import load_backbone
    from sae_pipeline.__main__ import main as sae_main
    from sae_pipeline.artifacts.export import EXPORT_FORMAT
    from sae_pipeline.features.explain import build_backbone, explain_images, image_records, write_pages
    from sae_pipeline.sae.config import sae_config

    name = args.explain_backbone
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        backbone = load_backbone(name)
    spec = backbone.spec
    record = {
        "backbone": json.loads(json.dumps(backbone.to_json())),
        "layer": backbone.layer,
        "weights": {"pretrained": False, "checkpoint_path": None, "seed": 0},
        "token_selection": None,
        "d": spec.d,
    }
    sae = make_sae(spec.d, args.explain_d_sae, args.k)
    sae_dpath = work / "explain_sae"
    sae_dpath.mkdir()
    config = {"format": EXPORT_FORMAT, **sae_config(sae), "d_in": sae.d_in, "d_sae": sae.d_sae}
    (sae_dpath / "config.json").write_text(json.dumps({**config, "data": {"extraction": record}}))
    save_file({k: v.contiguous() for k, v in sae.state_dict().items()}, str(sae_dpath / "sae.safetensors"))
    yy, xx = np.mgrid[0:256, 0:256] / 256.0
    image_fpath = work / "photo.jpg"
    Image.fromarray((np.stack([xx, yy, xx * yy], -1) * 255).astype(np.uint8)).save(image_fpath, quality=90)
    start = time.perf_counter()
    code = sae_main(
        ["features", "explain", "--sae", str(sae_dpath), "--images", str(image_fpath), "--out", str(work / "ex0")]
    )
    command = time.perf_counter() - start
    assert code == 0
    backbone = build_backbone(record, None, sae.d_in)
    records = image_records([str(image_fpath)])
    summary = {
        "sae": str(sae_dpath),
        "site": None,
        "backbone": name,
        "layer": backbone.layer,
        "images": [],
        "skipped": [],
    }
    bare_s, explain_s = [], []
    with torch.no_grad():
        for i in range(args.repeats):
            start = time.perf_counter()
            with Image.open(image_fpath) as image:
                pixels = backbone.preprocess(image.convert("RGB"))[None]
            tokens = backbone(pixels)
            sae.encode_sparse(tokens[0].float())
            bare_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            result = explain_images(sae, backbone, record, records, 1, "cpu")
            write_pages(work / f"ex{i + 1}", result, backbone, None, sae, summary)
            explain_s.append(time.perf_counter() - start)
            print(f"   round {i + 1}: bare forward + encode {bare_s[-1]:.3f} s, explain's image {explain_s[-1]:.3f} s")
    bare, ours = statistics.median(bare_s), statistics.median(explain_s)
    print(
        f"4. explain of one image: {name} ({spec.n_tokens} tokens of {spec.d}), TopK d_sae {sae.d_sae}, k {sae.k}, CPU"
    )
    print(f"   whole command (load SAE, build backbone, one image, its page): {command:.2f} s")
    print(f"   one image: bare forward + SAE encode {bare:.3f} s (median), explain {ours:.3f} s (median)")
    print(f"   explain / (bare forward + encode) = {ours / bare:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", nargs="+", default=["throughput", "memory", "site", "explain", "labels"])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--memory_images", type=int, default=200)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--d_sae", type=int, default=4096)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--site_d_sae", type=int, default=19_200)
    parser.add_argument("--site_images", type=int, default=4096)
    parser.add_argument("--site_labels", type=int, default=1000)
    parser.add_argument(
        "--site_rounds", type=int, default=2, help="builds per side, alternating (at most 2; 0: the label parts only)"
    )
    parser.add_argument("--explain_backbone", default="vit")
    parser.add_argument("--explain_d_sae", type=int, default=6144)
    parser.add_argument("--memory-child", dest="memory_child")
    add_stage_arguments(parser)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.d, args.d_sae, args.k, args.batch_size, args.device, args.top)
        return
    if args.quick:
        args.images, args.memory_images, args.d_sae, args.repeats = 20, 10, 512, 1
        args.site_d_sae, args.site_images, args.site_labels = 256, 64, 10
        args.explain_backbone, args.explain_d_sae, args.stage_batches = "vit_tiny", 512, 2
    from benchmarks.features.site import run_shares, site, site_shares
    from benchmarks.features.sparse import sparse_vs_dense
    from benchmarks.features.stages import stages

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        parts = {
            "throughput": throughput,
            "memory": memory,
            "site": site,
            "site_shares": site_shares,
            "run_shares": run_shares,
            "explain": explain,
            "labels": label_cost,
            "sparse": sparse_vs_dense,
            "stages": stages,
        }
        for part in args.parts:
            parts[part](args, work)


if __name__ == "__main__":
    main()
