"""``--data.cache ram|gpu``: the cached training stream yields the uncached stream's batches bit for bit (epochs,
ranks, workers, mid-epoch resume), reads the source once, refuses what does not fit in one line, and resumes
through the CLI. The gpu path runs on the CPU here (``gpu_cache_device``) and on CUDA where there is one."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data import Recorder, trainer

from sae_pipeline.data import ActivationDataModule, TrainTokenLoader
from sae_pipeline.data import cache as data_cache
from sae_pipeline.data.sources import ShardUnit

D = 8
COUNTS = [3, 11, 5, 7, 4, 9, 6, 8]  # images per shard (5 tokens each), uneven: uneven worker quotas
BATCH = 8
REPO_DPATH = Path(__file__).resolve().parents[1]
KINDS = [("ram", None), ("gpu", "cpu")]  # (cache, gpu_cache_device): the gpu path on the CPU


@pytest.fixture(scope="module")
def shards(tmp_path_factory, token_shards) -> Path:
    dpath = tmp_path_factory.mktemp("shards")
    token_shards(dpath, COUNTS, D)
    return dpath


def make_dm(source: str, cache: str | None = None, device: str | None = None, **kwargs) -> ActivationDataModule:
    args = {"batch_size": BATCH, "num_workers": 2, "shuffle_buffer_tokens": 24, "val_fraction": 0.2, "seed": 3}
    dm = ActivationDataModule(source, cache=cache, **{**args, **kwargs})
    dm.gpu_cache_device = device
    return dm


def loader(dm: ActivationDataModule, rank: int, world: int, epoch: int) -> TrainTokenLoader:
    """What ``train_dataloader`` builds, for any rank: the gpu cache's loader has no workers."""
    workers = 0 if dm.cache == "gpu" else dm.num_workers
    return TrainTokenLoader(dm.train_dataset(rank, world), num_workers=workers, epoch_fn=lambda: epoch)


def assert_same(got: list[dict], ref: list[dict]) -> None:
    assert len(got) == len(ref) > 0
    for a, b in zip(got, ref):
        assert a["x"].dtype == b["x"].dtype and a["x"].device.type == "cpu"
        assert a["x"].numpy().tobytes() == b["x"].numpy().tobytes()  # bit for bit
        assert a["shards"] == b["shards"]


@pytest.mark.parametrize("cache,device", KINDS)
@pytest.mark.parametrize("workers", [0, 2])
def test_cached_epochs_equal_the_uncached_stream_on_every_rank(shards, monkeypatch, cache, device, workers):
    plain, cached = make_dm(str(shards), num_workers=workers), make_dm(str(shards), cache, device, num_workers=workers)
    reads = []
    original = ShardUnit.read
    monkeypatch.setattr(ShardUnit, "read", lambda self, *a, **k: reads.append(self.name) or original(self, *a, **k))
    for epoch in range(3):
        for rank in range(2):
            got = list(loader(cached, rank, 2, epoch))
            if epoch == rank == 0:  # the fill: every training shard once, in source order, before the first batch
                assert reads == [unit.name for unit in cached.data_source.units("train", 0.2)]
            assert_same(got, list(loader(plain, rank, 2, epoch)))


def test_cached_epochs_read_only_memory(shards, monkeypatch):
    dm = make_dm(str(shards), "ram", num_workers=0)
    dm.train_dataset(0, 1)  # the fill
    monkeypatch.setattr(ShardUnit, "read", lambda *a, **k: pytest.fail("a cached epoch read a shard"))
    for epoch in range(2):
        assert list(loader(dm, 0, 1, epoch))


def test_cached_rows_equal_uncached_rows():
    """A row source (digits, float32) through the ram and the gpu path."""
    for cache, device in KINDS:
        cached = make_dm("digits", cache, device, batch_size=64, shuffle_buffer_tokens=256, num_workers=0)
        assert cached.train_dataset(0, 1).cache.dtype == torch.float32
        plain = make_dm("digits", batch_size=64, shuffle_buffer_tokens=256, num_workers=0)
        for epoch in range(2):
            assert_same(list(loader(cached, 0, 1, epoch)), list(loader(plain, 0, 1, epoch)))


@pytest.mark.parametrize("cache,device", KINDS)
@pytest.mark.parametrize("workers,n_done", [(2, 5), (2, 6), (3, 7), (0, 4)])
def test_cached_resume_mid_epoch_yields_the_uncached_rest(shards, cache, device, workers, n_done):
    full = list(loader(make_dm(str(shards), num_workers=workers), 0, 1, epoch=1))
    dm = make_dm(str(shards), cache, device, num_workers=workers)
    first = loader(dm, 0, 1, epoch=1)
    iterator = iter(first)
    for _ in range(n_done):
        next(iterator)
    state = first.state_dict()
    del iterator
    resumed = loader(dm, 0, 1, epoch=1)
    resumed.load_state_dict(state)
    assert_same(list(resumed), full[n_done:])


def test_shuffle_buffer_shuffles_indices_as_it_shuffles_rows():
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal((n, 3)).astype(np.float16) for n in (5, 7, 3, 9, 8)]
    rows, offsets = np.concatenate(parts), np.cumsum([0, 5, 7, 3, 9])
    from sae_pipeline.data.streams import ShuffleBuffer

    by_rows, by_index = ShuffleBuffer(12, 4, np.random.default_rng(7)), ShuffleBuffer(12, 4, np.random.default_rng(7))
    index_parts = [(u, np.arange(offsets[u], offsets[u] + len(p))) for u, p in enumerate(parts)]
    got = [by_index.tokens[s] for s in by_index.batches(iter(index_parts))]
    ref = [by_rows.tokens[s].copy() for s in by_rows.batches(iter(enumerate(parts)))]
    assert len(got) == len(ref) == 8
    assert all(np.array_equal(rows[i], r) for i, r in zip(got, ref))


def test_gpu_path_trains_on_the_cache_device_without_workers_or_pinning(shards, tmp_path):
    """Through Lightning: the loader runs in the main process, the batch arrives from the cache as float16 and
    the step sees float32 on the device; the same batches as the uncached run."""
    dm = make_dm(str(shards), "gpu", "cpu", num_workers=2, val_fraction=0.0)
    recorder = Recorder()
    trainer(tmp_path, max_epochs=2, enable_checkpointing=False).fit(recorder, datamodule=dm)
    assert dm.train_dataloader().num_workers == 0 and not dm.train_dataloader().pin_memory
    assert recorder.before == {(torch.float16, False)} and recorder.in_step == {(torch.float32, "cpu")}
    plain = make_dm(str(shards), num_workers=2, val_fraction=0.0)
    ref = [hashlib.sha1(b["x"].float().numpy().tobytes()).hexdigest() for e in (0, 1) for b in loader(plain, 0, 1, e)]
    assert recorder.seen == ref


def test_bad_value_and_what_does_not_fit_are_one_line_errors(shards, monkeypatch):
    with pytest.raises(ValueError, match=r"^--data.cache='disk': accepted values are none, ram, gpu$"):
        make_dm(str(shards), "disk")
    assert make_dm(str(shards), "none").cache is None
    n_bytes = sum(u.n_tokens for u in make_dm(str(shards)).data_source.units("train", 0.2)) * D * 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(data_cache, "mem_available", lambda: 8 * n_bytes - 2)  # half is just under 4 ranks' need
    dm = make_dm(str(shards), "ram", num_workers=0)
    with pytest.raises(ValueError) as info:
        dm.train_dataset(0, 1)
    message = str(info.value)
    assert "\n" not in message and "--data.cache ram" in message and "--data.cache none" in message
    needs = f"needs {data_cache.size_text(n_bytes)} x 4 ranks on this node = {data_cache.size_text(4 * n_bytes)}"
    assert f"{needs}, more than half of the {data_cache.size_text(8 * n_bytes - 2)} of available memory" in message
    assert dm._train_cache is None  # nothing was read
    monkeypatch.setattr(data_cache, "mem_available", lambda: 8 * n_bytes)
    assert make_dm(str(shards), "ram", num_workers=0).train_dataset(0, 1).cache is not None  # fits exactly
    monkeypatch.setattr(data_cache, "shm_free", lambda: 4 * n_bytes - 1)  # workers need /dev/shm room
    with pytest.raises(ValueError, match=r"/dev/shm has free .*--shm-size"):
        make_dm(str(shards), "ram", num_workers=2).train_dataset(0, 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * n_bytes - 2, 10 * n_bytes))
    with pytest.raises(
        ValueError, match=r"^--data.cache gpu: the training split needs .* more than half of the .* free on cuda:0; use"
    ):
        data_cache.check_fits("gpu", n_bytes, torch.device("cuda", 0))
    data_cache.check_fits("gpu", n_bytes - 1, torch.device("cuda", 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_cache_without_cuda_is_one_line(shards, tmp_path):
    with pytest.raises(ValueError, match=r"^--data.cache gpu needs a CUDA device but CUDA is not available; use"):
        make_dm(str(shards), "gpu").train_dataset(0, 1)
    dm = make_dm(str(shards), "gpu", val_fraction=0.0)
    with pytest.raises(ValueError, match=r"needs a CUDA device but the trainer runs on cpu"):
        trainer(tmp_path, max_epochs=1).fit(Recorder(), datamodule=dm)  # in setup("fit"), before any step


def test_fit_with_cache_saves_the_flag_and_resumes_like_the_uncached_run(tmp_path, monkeypatch):
    """Through the CLI: ``--data.cache ram`` lands in config.yaml and the checkpoint; a cached fit, and a cached fit
    resumed mid-epoch with ``--ckpt_path last``, end with the weights of the uncached fit."""
    import shutil

    from sae_pipeline.__main__ import main

    monkeypatch.chdir(tmp_path)
    config = str(REPO_DPATH / "configs" / "mpsae_digits.yaml")
    args = ["fit", "--config", config, "--model.sae.init_args.d_sae", "64", "--trainer.max_epochs", "2"]
    args += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    assert main([*args, "--trainer.default_root_dir", "plain"]) == 0
    cached = [*args, "--trainer.default_root_dir", "cached", "--data.cache", "ram"]
    every = ["--checkpoint.every_n_train_steps", "2", "--checkpoint.save_top_k", "-1"]
    assert main([*cached, *every]) == 0  # 6 batches an epoch, 12 steps
    run = tmp_path / "cached" / "mpsae_digits" / "version_0"
    assert "cache: ram" in (run / "config.yaml").read_text()
    (plain,) = (tmp_path / "plain").rglob("last.ckpt")
    plain = torch.load(plain, weights_only=True)
    # What a kill -9 during step 9 leaves: last.ckpt as the periodic save after step 8 wrote it (epoch 1, 2 of 6).
    (step_8,) = (run / "checkpoints").glob("*-step=8.ckpt")
    assert torch.load(step_8, weights_only=True)["datamodule_hyper_parameters"]["cache"] == "ram"
    ends = [torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)]
    shutil.copyfile(step_8, run / "checkpoints" / "last.ckpt")
    assert main([*cached, "--ckpt_path", "last"]) == 0
    ends.append(torch.load(run.parent / "version_1" / "checkpoints" / "last.ckpt", weights_only=True))
    for end in ends:
        assert plain["global_step"] == end["global_step"] == 12
        for name, value in plain["state_dict"].items():
            torch.testing.assert_close(end["state_dict"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_fit_with_gpu_cache_without_cuda_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    from sae_pipeline.__main__ import main

    monkeypatch.chdir(tmp_path)
    config = str(REPO_DPATH / "configs" / "mpsae_digits.yaml")
    assert main(["fit", "--config", config, "--data.cache", "gpu", "--trainer.enable_progress_bar", "false"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (
        "error: ValueError: --data.cache gpu needs a CUDA device but the trainer runs on cpu; use --data.cache ram or "
        "--data.cache none"
    )
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_cache_gathers_the_uncached_batches_on_the_device(shards, tmp_path, workers):
    dm = make_dm(str(shards), "gpu", num_workers=workers, val_fraction=0.0)
    assert dm.train_dataset(0, 1).cache.device.type == "cuda"
    plain = make_dm(str(shards), num_workers=workers, val_fraction=0.0)
    for rank in range(2):
        torch.cuda.set_sync_debug_mode("error")  # the host never waits for the device to hand a batch over
        try:
            got = list(loader(dm, rank, 2, 1))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for a, b in zip(got, loader(plain, rank, 2, 1), strict=True):
            assert a["x"].device.type == "cuda" and torch.equal(a["x"].cpu(), b["x"])
    recorder = Recorder()
    dm = make_dm(str(shards), "gpu", num_workers=workers, val_fraction=0.0)
    trainer(tmp_path, accelerator="cuda", devices=1, max_epochs=2, enable_checkpointing=False).fit(
        recorder, datamodule=dm
    )
    assert recorder.in_step == {(torch.float32, "cuda")}
    ref = [hashlib.sha1(b["x"].float().numpy().tobytes()).hexdigest() for e in (0, 1) for b in loader(plain, 0, 1, e)]
    assert recorder.seen == ref


def in_forked_child(function) -> str:
    """What ``function()`` returned, or ``Type: message`` of what it raised, in a forked child of this process:
    a limit set there (``resource.setrlimit``) binds the child alone, and the fork costs milliseconds."""
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            text = str(function())
        except BaseException as exn:  # noqa: BLE001 -- reported to the parent, whatever it is
            text = f"{type(exn).__name__}: {exn}"
        os.write(write, text.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    return text


def test_ulimit_v_is_part_of_the_fit_check_and_a_refused_mmap_is_one_line():
    """Issue 43, item 4: ``--data.cache ram`` under ``ulimit -v`` ended in a 78-line OSError from the cache's mmap.
    In a child whose RLIMIT_AS leaves it 512 MiB: the fit check refuses a split needing more than half of that,
    and an allocation refused all the same is one line naming the cache, its size and the fix."""
    import resource
    from types import SimpleNamespace

    from feature_extraction.allocation import address_space_used

    def under_the_limit() -> str:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (address_space_used() + 512 * 2**20, hard))
        lines = []
        data_cache.check_fits("ram", 64 * 2**20, torch.device("cpu"))  # fits in half
        try:
            data_cache.check_fits("ram", 400 * 2**20, torch.device("cpu"))
        except ValueError as exn:
            lines.append(str(exn))
        units = [SimpleNamespace(n_tokens=2**20, name="unit")]  # 1 GiB of float16 rows of 512: the mmap fails
        try:
            data_cache.fill(units, 512, np.dtype(np.float16), torch.device("cpu"))
        except ValueError as exn:
            lines.append(f"{type(exn).__name__}: {exn}")
        return "\n".join(lines)

    check, refused = in_forked_child(under_the_limit).splitlines()
    needs = data_cache.size_text(400 * 2**20)
    assert check.startswith(f"--data.cache ram: the training split needs {needs}, more than half of the ")
    assert check.endswith(
        " of address space that ulimit -v (RLIMIT_AS) leaves this process; use --data.cache none (read the shards "
        "every epoch), or raise ulimit -v"
    )
    assert refused.startswith(
        "AllocationError: --data.cache ram: the training split in host memory: could not allocate "
        f"{data_cache.size_text(2**30)} (Cannot allocate memory; ulimit -v leaves this process "
    )
    assert refused.endswith("use --data.cache none (read the shards every epoch), or free memory (raise ulimit -v)")


def test_a_device_cache_or_a_pinned_batch_that_cannot_be_allocated_is_one_line(shards, monkeypatch):
    """The errors torch raises when device memory or pinned host memory runs out (simulated: no GPU here) become
    one line naming what was allocated and the fix, not a traceback."""
    from feature_extraction.allocation import AllocationError

    empty = torch.empty

    def no_device_memory(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")
        return empty(*args, device=device, **kwargs)

    units = make_dm(str(shards)).data_source.units("train", 0.2)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", no_device_memory)
        with pytest.raises(AllocationError) as info:
            data_cache.fill(units, D, np.dtype(np.float16), torch.device("cuda", 0))
    n_bytes = sum(unit.n_tokens for unit in units) * D * 2
    assert str(info.value) == (
        f"--data.cache gpu: the training split in cuda:0: could not allocate {data_cache.size_text(n_bytes)} (CUDA "
        "out of memory); use --data.cache ram, --data.cache none, or free memory on the GPU (another process may "
        "hold it)"
    )

    def no_pinned_memory(data, device=None):
        raise torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # as on a GPU machine: the loader pins
    monkeypatch.setattr(torch.utils.data._utils.pin_memory, "pin_memory", no_pinned_memory)
    dm = make_dm(str(shards), num_workers=0)
    with pytest.raises(AllocationError) as info:
        next(iter(TrainTokenLoader(dm.train_dataset(0, 1), num_workers=0, pin_memory=True)))
    assert str(info.value) == (
        f"the data loader: a batch in pinned host memory, for the copy to the GPU: could not allocate "
        f"{data_cache.size_text(BATCH * D * 2)} (CUDA error: out of memory); lower --data.batch_size or "
        "--data.num_workers, or free host memory (pinned pages stay in RAM)"
    )


def test_fit_whose_cache_cannot_be_allocated_exits_2_and_leaves_no_run(tmp_path, monkeypatch, capsys):
    """Through the CLI: the cache's mmap refused (ENOMEM, as under ulimit -v) is one line, exit 2, and the fit's new
    version_N (which TensorBoard had begun) is removed: no empty run is left."""
    import errno
    import mmap

    from sae_pipeline.__main__ import main

    real_mmap = mmap.mmap

    def refused(fileno, length, *args, **kwargs):
        if length <= 64 * 1024:  # small maps (the stop flag's page) are not the cache
            return real_mmap(fileno, length, *args, **kwargs)
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(mmap, "mmap", refused)
    config = str(REPO_DPATH / "configs" / "mpsae_digits.yaml")
    args = ["fit", "--config", config, "--model.sae.init_args.d_sae", "64", "--data.cache", "ram"]
    assert main([*args, "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(
        "error: AllocationError: --data.cache ram: the training split in host memory: could not allocate "
    )
    assert "(Cannot allocate memory); use --data.cache none" in lines[0]
    assert list(tmp_path.iterdir()) == []  # no runs/mpsae_digits/version_0
