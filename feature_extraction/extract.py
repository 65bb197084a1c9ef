"""The extraction command: images -> one backbone layer's tokens -> webdataset shards.

`extract` is what `python -m feature_extraction` runs, once per SLURM array task (or
torchrun rank, or alone). `finalize` (`shards/finalize.py`) assembles `manifest.json` once every shard exists.
This module decides what to write (arguments, output checks, `extraction.json`, the task split); the hot loop
that writes it (`write_shards`, `forward_tokens`) is `shard_loop.py`.

Design choices:

- Every task lists the same images and assigns them to shards the same way (sorted keys,
  fixed `shard_size`, `shards.layout.assign_shards`), then writes only the shards it owns
  (`shards.layout.shards_for_task`: strided). No coordination is needed beyond the file system.
- Batches never span two shards. A shard's batches are then the same whichever shards a
  task skips, so a resumed or differently split run computes every sample from the same
  batch and, on the CPU in float32, produces byte-identical shards.
- Resume is "skip the shards whose tar and sidecar are complete and intact, redo the others"
  (each complete shard the task owns is read once and checked against its sidecar's xxh3-64,
  `integrity`, so a shard corrupted on disk is written again):
  `write_shard` streams to a `.tmp` file and renames, so a job killed at any point leaves
  complete shards and a few partial `.tmp` files that the rerun overwrites (the writer
  processes die with the main process, so none outlives it to race the rerun).
- Undecodable images, and images whose mode has no conversion to RGB (`image_modes`), are
  skipped and counted, with the reason; each shard's skipped images go to
  `skipped-NNNNNN.json`, written before its sidecar, and `finalize` merges them into
  the manifest's `skipped`. A skipped image changes its shard's count, not the assignment.
- Each task locks its part of the directory (`output_lock`, `.lock.K-of-N`) while it writes, so a
  second run of the same task, or of another split, is refused instead of writing the same
  shards at the same time; the lock of a killed task is taken over by the rerun.
- `extraction.json` (written first, compared on every rerun and by every task) records
  what the directory holds: backbone, layer, weights, shard size and the image list's
  digest. Another backbone, layer or image set is refused instead of mixed in.
- Random weights (`pretrained=False` without a checkpoint) are drawn after
  `torch.manual_seed(seed)`, so every task of an array job builds the same model.
- The forward runs under `torch.inference_mode` (bf16 autocast on CUDA); tokens are
  stored as float16. Writer processes stream finished batches into the tars (several shards
  at once: writing a ViT-B sample costs about as much as a GPU forward of it), hashing and
  summing statistics while the next batches run.
- `--tokens_per_image N` stores N seeded patch tokens per image (and the prefix tokens
  unless `--keep_prefix_tokens false`), chosen by `token_selection` from the seed and the
  image id alone, so task splits and reruns store the same tokens. The subset is gathered
  on the device before the copy to the host, so the copy, the shared memory and the
  writers all shrink with it; each sample then also holds `positions.npy`.
- `--out s3://bucket/prefix` (any fsspec URL): the same extraction runs into a local staging folder
  (`--stage`) and each shard is uploaded whole as soon as it is written, the manifest last;
  resume continues from the whole shards in the bucket (`remote_out.py`). The stage is removed once
  the task's uploads succeed, unless another task of the host still uses it (`stage_lease.py`).
- Image ids may contain '.', which webdataset reads as the start of the extension, so a
  sample's `__key__` is the id percent-escaped (`shards.layout.image_key`, reversible by
  `image_id_from_key`); `meta.json` keeps the original id, its source and `image_xxh3_64`,
  the xxh3-64 of the image's bytes as decoded (`images.content_hash`): the feature browser
  draws an image only while its bytes still hash to that.
"""

from __future__ import annotations

import functools
import logging
import os
from contextlib import nullcontext
from pathlib import Path

import torch

from feature_extraction import __version__
from feature_extraction.backbones import get_backbone_spec, load_backbone
from feature_extraction.images import ImageDataset, list_images
from feature_extraction.output_dirs import check_output_path, prepare_output_dir
from feature_extraction.output_lock import output_lock
from feature_extraction.remote_out import ShardUploader, StageSpace, default_stage, prepare_stage, resume_plan
from feature_extraction.shard_loop import write_shards
from feature_extraction.shards import (
    assign_shards,
    format_indices,
    image_id_from_key,
    image_key,
    shard_is_complete,
    shard_is_intact,
    shards_for_task,
)
from feature_extraction.shards.finalize import check_or_create_record, finalize_if_last, ids_digest
from feature_extraction.stage_lease import StageLease
from feature_extraction.store import RemotePath, location
from feature_extraction.token_selection import make_selection, selected_positions, token_kinds
from feature_extraction.validate import check_int

__all__ = ["default_task", "extract", "image_id_from_key", "image_key"]

logger = logging.getLogger(__name__)


def default_task(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """`(task_index, num_tasks)` from SLURM array variables, else torchrun's RANK/WORLD_SIZE, else (0, 1).

    SLURM array ids need not start at 0 (`--array=1-8`) or be contiguous (`0-14:2`), so the
    index is `(SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP`.
    """
    env = os.environ if environ is None else environ
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        step = int(env.get("SLURM_ARRAY_TASK_STEP", "1") or 1)
        offset = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", "0") or 0)
        index, count = offset // step, int(env["SLURM_ARRAY_TASK_COUNT"])
        if offset % step or not 0 <= index < count:
            raise ValueError(
                f"SLURM array task {env['SLURM_ARRAY_TASK_ID']} does not map to an index in "
                f"[0, {count - 1}] (use --array=0-N or pass --task_index and --num_tasks)"
            )
        return index, count
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    return 0, 1


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            local_rank = os.environ.get("LOCAL_RANK")  # torchrun: one GPU per rank
            return torch.device(f"cuda:{local_rank}" if local_rank else "cuda")
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but no CUDA device is visible; use --device cpu or auto")
    return resolved


def extract(
    backbone: str,
    images: str,
    out: str,
    pretrained: bool = False,
    checkpoint_path: str | None = None,
    layer: int = -1,
    batch_size: int = 64,
    shard_size: int = 1000,
    num_workers: int = 4,
    device: str = "auto",
    task_index: int | None = None,
    num_tasks: int | None = None,
    seed: int = 0,
    num_writers: int = 4,
    progress: bool = True,
    tokens_per_image: int | None = None,
    keep_prefix_tokens: bool = True,
    stage: str | None = None,
) -> dict:
    """Extract one layer's tokens of every image into this task's shards; finalize if it is the last task.

    `python -m feature_extraction finalize --out DIR` assembles manifest.json explicitly.

    Args:
        backbone: registry name (dinov2, siglip, clip, vit, their _large and _tiny entries).
        images: an image folder (class sub-folders give labels), a directory of webdataset
            image tars, or `samples` (scikit-image's bundled photos).
        out: output directory, or a URL (s3://bucket/prefix) the shards are uploaded to; one per backbone and
            layer (a rerun resumes it).
        pretrained: download the library's pretrained weights (needs the network).
        checkpoint_path: local weights (.safetensors or torch state dict) instead.
        layer: transformer block; -1 = the final block after the final norm (the paper's).
        batch_size: images per forward pass (batches never span two shards).
        shard_size: images per shard.
        num_workers: DataLoader workers decoding images.
        device: auto (cuda if available, else cpu), cpu, cuda or cuda:N.
        task_index: this task's index; default from SLURM_ARRAY_TASK_ID, else RANK, else 0.
        num_tasks: number of tasks; default SLURM_ARRAY_TASK_COUNT, else WORLD_SIZE, else 1.
        seed: torch seed of random weights (pretrained false, no checkpoint), equal in all tasks, and
            the seed of the token subset (--tokens_per_image).
        num_writers: processes writing shards in parallel (each holds up to one shard of tokens in
            shared memory, /dev/shm: give Docker containers --shm-size).
        progress: show a progress bar (images/s, ETA) on stderr.
        tokens_per_image: store this many patch tokens per image, a subset seeded by --seed and the
            image id (the same in every task and rerun); default: every patch. Cuts disk in proportion.
        keep_prefix_tokens: also store the CLS and register tokens (false: patches only).
        stage: with a URL --out, the local folder each shard is written to before its upload (deleted from
            there once uploaded: needs room for about num_writers + 8 shards; the folder itself is removed when
            the task succeeds and no other task uses it); default: a folder in the system temp dir named after
            the URL. Ignored for a local --out.
    """
    for name, value, minimum in (
        ("batch_size", batch_size, 1),
        ("shard_size", shard_size, 1),
        ("num_workers", num_workers, 0),
        ("num_writers", num_writers, 1),
    ):
        check_int(f"--{name}", value, minimum)
    env_index, env_count = default_task()
    task_index = env_index if task_index is None else task_index
    num_tasks = env_count if num_tasks is None else num_tasks
    check_int("--num_tasks", num_tasks, 1)
    check_int("--task_index", task_index, 0, num_tasks - 1, note=f" for --num_tasks {num_tasks}")
    spec = get_backbone_spec(backbone)
    selection = make_selection(tokens_per_image, keep_prefix_tokens, seed, spec.n_prefix_tokens, spec.grid, spec.name)
    torch_device = _resolve_device(device)
    if torch_device.type == "cuda" and torch_device.index is not None:
        torch.cuda.set_device(torch_device)  # pinned buffers and the DataLoader's pin thread follow it
    records = list_images(os.path.expanduser(images))
    keys = [image_key(r.image_id) for r in records]
    by_key = {key: i for i, key in enumerate(keys)}
    shards = assign_shards(keys, shard_size)
    target = location(out, "--out")  # a URL with credentials in it is refused here, before anything is logged
    stage_dpath = None
    if isinstance(target, RemotePath):
        target.is_dir()  # an unknown bucket or refused credentials: one line before the backbone loads
        stage_dpath = Path(stage).expanduser() if stage else default_stage(target)
        check_output_path(stage_dpath, "--stage")
    else:
        check_output_path(out, "--out")  # before the backbone loads: a bad --out costs nothing (and creates nothing)
    if checkpoint_path is not None:
        checkpoint_path = os.path.abspath(os.path.expanduser(checkpoint_path))
    random_weights = not pretrained and checkpoint_path is None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = load_backbone(backbone, pretrained=pretrained, checkpoint_path=checkpoint_path, layer=layer)
    # after the backbone's checks: a bad --layer leaves no folder
    out_dpath = prepare_output_dir(out, "--out") if stage_dpath is None else prepare_output_dir(stage_dpath, "--stage")
    model.to(torch_device)

    record = {
        "backbone": spec.name,
        "layer": model.layer,
        "shard_size": shard_size,
        "n_images": len(records),
        "n_shards": len(shards),
        "ids_sha256": ids_digest(keys),
        "weights": {
            "pretrained": pretrained,
            "checkpoint_path": checkpoint_path,
            "seed": seed if random_weights else None,
        },
        "images": images,
        "key_scheme": "percent-escaped image id (feature_extraction.extract.image_key)",
        "backbone_record": model.to_json(),
        "package_version": __version__,
        "token_selection": selection,
    }
    target = out_dpath if stage_dpath is None else target
    stage_lease = nullcontext() if stage_dpath is None else StageLease(out_dpath)  # held while this task stages
    with output_lock(target, "extract", part=(task_index, num_tasks)), stage_lease:  # one writer per task's shards
        check_or_create_record(target, record)

        owned = shards_for_task(len(shards), task_index, num_tasks)
        staged: list[int] = []
        if stage_dpath is not None:
            prepare_stage(out_dpath, record)
            _, staged, todo = resume_plan(target, out_dpath, owned)
        else:
            complete = [i for i in owned if shard_is_complete(out_dpath, i)]
            corrupt = [i for i in complete if not shard_is_intact(out_dpath, i)]  # reads each complete shard once
            if corrupt:
                logger.warning(
                    "shards %s: their bytes no longer match their sidecars (corrupt); writing them again",
                    format_indices(corrupt),
                )
            todo = [i for i in owned if i not in complete or i in corrupt]
        logger.info(
            "task %d/%d: %d of %d shards owned, %d complete, %d to write (%s layer %d on %s)",
            task_index,
            num_tasks,
            len(owned),
            len(shards),
            len(owned) - len(todo),
            len(todo),
            spec.name,
            model.layer,
            torch_device,
        )
        if selection is not None:
            stored = sum(token_kinds(spec.n_prefix_tokens, spec.grid, selection).values())
            logger.info(
                "storing %d of %d tokens per image: %d seeded patches (seed %d)%s",
                stored,
                spec.n_tokens,
                selection["patches_per_image"],
                selection["seed"],
                " and the prefix tokens" if selection["keep_prefix_tokens"] and spec.n_prefix_tokens else "",
            )
        uploader = None if stage_dpath is None else ShardUploader(out_dpath, target, staged)
        stage_space = None if stage_dpath is None else StageSpace(out_dpath, target, num_writers)  # a full --stage
        # the uploader waits for the last uploads; drops the queue on an error or interrupt
        with stage_space or nullcontext(), uploader or nullcontext():
            counts = write_shards(
                model,
                ImageDataset(records, model.preprocess),
                records,
                [(i, [by_key[k] for k in shards[i]]) for i in todo],
                out_dpath,
                batch_size=batch_size,
                num_workers=num_workers,
                device=torch_device,
                num_writers=num_writers,
                progress=progress,
                positions_of=None
                if selection is None
                else functools.partial(
                    selected_positions, selection=selection, n_prefix_tokens=spec.n_prefix_tokens, grid=spec.grid
                ),
                on_shard_written=None if uploader is None else uploader.submit,
            )
        if stage_space is not None:
            stage_space.raise_if_full()  # one line, exit 2 (remote_out.StageSpace)
        finalized = finalize_if_last(target, len(shards))
        if stage_dpath is not None:  # every shard this task owns is in the bucket: its staged files go
            stage_lease.finish(owned)
    return {
        "out": str(target),
        "task_index": task_index,
        "num_tasks": num_tasks,
        "n_shards": len(shards),
        "shards_written": todo,
        "shards_already_complete": len(owned) - len(todo),
        **counts,
        "images_per_second": counts["images"] / max(counts["seconds"], 1e-9),
        "finalized": finalized,
    }
