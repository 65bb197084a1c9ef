"""Benchmark: the extraction command's hot loop against a bare forward loop, same run, same batches.

    python -m benchmarks.extract                                  # CPU, vit_tiny (2 blocks, 64 px)
    python -m benchmarks.extract --backbone dinov2_tiny --batch_size 64
    python -m benchmarks.extract --device cuda --backbone dinov2 --batch_size 256 --n_images 8192

Both sides see the same pre-decoded, preprocessed images in the same batches:

- command: `feature_extraction.shard_loop.write_shards`, the function `python -m
  feature_extraction` runs: DataLoader + collate, forward under inference_mode (bf16
  autocast on CUDA), float16 tokens to the host, a writer thread that streams them into
  webdataset tars (sha256, float64 statistics, fsync, rename, sidecar).
- bare: `backbone(pixels)` under inference_mode (bf16 autocast on CUDA) on the stacked
  batches, nothing kept. This is the upper bound; the target is command/bare >= 0.9.

Each side runs `--repeats` times, alternating, after a warm-up; the best time of each is
reported (the least disturbed by other processes). On CUDA it also prints the forward's
FLOPs per image (torch's FlopCounterMode) and the command's fraction of the GPU's dense
bf16 peak (`--peak_tflops`, else looked up from the device name). `--end_to_end` also
times the whole `extract()` on scikit-image's photos, decoding included (information only).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from feature_extraction.backbones import load_backbone
from feature_extraction.extract import extract
from feature_extraction.images import ImageDataset, ImageRecord, list_images
from feature_extraction.shard_loop import write_shards

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), from the vendors' data sheets.
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 SXM": 989.4,
    "H100 80GB HBM3": 989.4,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "A100": 312.0,
    "L40S": 362.1,
    "A10": 125.0,
    "L4": 121.0,
}


class PreDecoded(torch.utils.data.Dataset):
    """Item i is `(i, pixels, content hash)`, like ImageDataset, but the pixels were decoded beforehand."""

    def __init__(self, pixels: list[torch.Tensor]) -> None:
        self.pixels = pixels

    def __len__(self) -> int:
        return len(self.pixels)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, str]:
        return i, self.pixels[i], f"{i:016x}"


def decoded_photos(backbone, n_images: int) -> tuple[list[ImageRecord], list[torch.Tensor]]:  # noqa: ANN001
    """`n_images` preprocessed pixels, cycling through scikit-image's photos; records named img-000123."""
    photos = list_images("samples")
    dataset = ImageDataset(photos, backbone.preprocess)
    decoded = [dataset[i][1] for i in range(len(photos))]
    records = [
        ImageRecord(f"img-{i:06d}", "samples", None, kind="samples", member=photos[i % len(photos)].member)
        for i in range(n_images)
    ]
    return records, [decoded[i % len(decoded)].clone() for i in range(n_images)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_bare(backbone, batches: list[torch.Tensor], device: torch.device) -> float:  # noqa: ANN001
    on_cuda = device.type == "cuda"
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda):
        for pixels in batches:
            backbone(pixels.to(device, non_blocking=True))
    sync(device)
    return time.perf_counter() - start


def time_command(
    backbone,
    dataset,
    records,
    shard_size: int,
    batch_size: int,
    num_workers: int,  # noqa: ANN001
    device: torch.device,
    work_dpath: Path,
    num_writers: int = 4,
) -> float:
    out = work_dpath / "shards"
    shutil.rmtree(out, ignore_errors=True)
    plan = [
        (s, list(range(start, min(start + shard_size, len(records)))))
        for s, start in enumerate(range(0, len(records), shard_size))
    ]
    sync(device)
    start = time.perf_counter()
    write_shards(
        backbone,
        dataset,
        records,
        plan,
        out,
        batch_size=batch_size,
        num_workers=num_workers,
        device=device,
        num_writers=num_writers,
        progress=False,
    )
    sync(device)
    return time.perf_counter() - start


def flops_per_image(backbone, device: torch.device) -> float:  # noqa: ANN001
    from torch.utils.flop_counter import FlopCounterMode

    size = backbone.spec.image_size
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        backbone(torch.zeros(2, 3, size, size, device=device))
    return counter.get_total_flops() / 2


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="vit_tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n_images", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--shard_size", type=int, default=256)
    parser.add_argument("--num_workers", type=int, default=0, help="DataLoader workers of the command side")
    parser.add_argument("--num_writers", type=int, default=4, help="shard-writing threads of the command side")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak_tflops", type=float, default=None, help="dense bf16 peak of the GPU")
    parser.add_argument("--end_to_end", action="store_true", help="also time extract() on the samples, decoding")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    backbone = load_backbone(args.backbone).to(device)
    records, pixels = decoded_photos(backbone, args.n_images)
    dataset = PreDecoded(pixels)
    batches = [torch.stack(pixels[i : i + args.batch_size]) for i in range(0, len(pixels), args.batch_size)]
    if device.type == "cuda":
        batches = [b.pin_memory() for b in batches]

    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        work_dpath = Path(tmp)
        time_bare(backbone, batches[:2], device)  # warm-up (kernels, allocator, threads)
        time_command(
            backbone,
            PreDecoded(pixels[: 2 * args.batch_size]),
            records[: 2 * args.batch_size],
            args.shard_size,
            args.batch_size,
            0,
            device,
            work_dpath,
        )
        bare, command = [], []
        for _ in range(args.repeats):
            bare.append(time_bare(backbone, batches, device))
            command.append(
                time_command(
                    backbone,
                    dataset,
                    records,
                    args.shard_size,
                    args.batch_size,
                    args.num_workers,
                    device,
                    work_dpath,
                    args.num_writers,
                )
            )
        n_bytes = sum(p.stat().st_size for p in (work_dpath / "shards").glob("*.tar"))
        end_to_end = None
        if args.end_to_end:
            out = work_dpath / "e2e"
            summary = extract(
                args.backbone,
                "samples",
                str(out),
                batch_size=args.batch_size,
                shard_size=4,
                num_workers=args.num_workers,
                device=args.device,
                progress=False,
            )
            end_to_end = summary["images_per_second"]

    bare_rate, command_rate = args.n_images / min(bare), args.n_images / min(command)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(
        f"extraction: {args.backbone} ({backbone.n_tokens} tokens x d={backbone.spec.d}), {args.n_images} images, "
        f"batch {args.batch_size}, shard {args.shard_size}, {args.num_writers} writers, device {device}"
        f"{' ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}{threads}, best of "
        f"{args.repeats}"
    )
    print(f"  bare forward      {bare_rate:10.1f} images/s")
    print(f"  command path      {command_rate:10.1f} images/s   ({n_bytes / min(command) / 2**20:.1f} MiB/s of shards)")
    ratio = command_rate / bare_rate
    print(f"  ratio command/bare: {ratio:.3f}  (target >= 0.9: {'met' if ratio >= 0.9 else 'NOT met'})")
    if end_to_end is not None:
        print(f"  end to end on samples (decoding in {args.num_workers} workers): {end_to_end:.1f} images/s")
    if device.type == "cuda":
        flops = flops_per_image(backbone, device)
        peak = peak_tflops(device, args.peak_tflops)
        achieved = command_rate * flops / 1e12
        share = f", {achieved / peak:.1%} of the {peak:.0f} TFLOP/s bf16 peak" if peak else " (peak unknown)"
        print(f"  forward {flops / 1e9:.1f} GFLOP/image; command achieves {achieved:.1f} TFLOP/s{share}")


if __name__ == "__main__":
    main()
