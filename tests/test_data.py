"""ActivationDataModule: splits over ranks x workers, shuffle, equal batches, val/predict coverage, errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from feature_extraction import shards as S
from sae_pipeline.data import ActivationDataModule, TokenLoader, TrainTokenLoader
from sae_pipeline.data.streams import ShuffleBuffer

D, TPI = 8, 5  # tokens per image: 1 prefix token + a 2x2 grid
COUNTS = [3, 11, 5, 7, 4, 9, 6]  # images per shard: deliberately uneven
BATCH = 8


def key_of(row: np.ndarray | torch.Tensor) -> bytes:
    """Identity of a token: its float16 bytes (float16 -> float32 -> float16 is exact)."""
    return np.asarray(row, dtype=np.float32).astype(np.float16).tobytes()


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, token_shards) -> tuple[Path, dict, list[set]]:
    """7 shards; returns the dir, token key -> (image id, position, shard index), and each shard's token keys."""
    dpath = tmp_path_factory.mktemp("shards")
    samples_per_shard = token_shards(dpath, COUNTS, D)
    where = {
        key_of(row): (key, pos, index)
        for index, samples in enumerate(samples_per_shard)
        for key, tokens, _ in samples
        for pos, row in enumerate(tokens)
    }
    per_shard = [{key_of(row) for _, tokens, _ in samples for row in tokens} for samples in samples_per_shard]
    assert len(where) == sum(COUNTS) * TPI  # the keys are unique
    return dpath, where, per_shard


def make_dm(dpath: Path, **kwargs) -> ActivationDataModule:
    args = {"batch_size": BATCH, "num_workers": 2, "shuffle_buffer_tokens": 32, "val_fraction": 0.2, "seed": 0}
    return ActivationDataModule(str(dpath), **{**args, **kwargs})


def epoch_batches(dm: ActivationDataModule, rank: int, world: int, epoch: int = 0) -> list[dict]:
    loader = TrainTokenLoader(dm.train_dataset(rank, world), num_workers=dm.num_workers, epoch_fn=lambda: epoch)
    return list(loader)


def split_sets(dm, per_shard) -> tuple[set, set]:
    val_names = {u.name for u in dm.data_source.units("val", dm.val_fraction)}
    fpaths = [str(p) for p in S.shard_fpaths(dm.source, dm.manifest)]
    val = set().union(*(per_shard[i] for i, f in enumerate(fpaths) if f in val_names))
    train = set().union(*(per_shard[i] for i, f in enumerate(fpaths) if f not in val_names))
    return train, val


@pytest.mark.parametrize("world,workers", [(1, 2), (2, 2), (3, 1)])
def test_train_epoch_covers_train_tokens_once_with_equal_batches(shard_dir, world, workers):
    dpath, _, per_shard = shard_dir
    dm = make_dm(dpath, num_workers=workers)
    train, val = split_sets(dm, per_shard)
    assert len(val) == 7 * TPI  # round(0.2 * 7) = 1 whole shard held out (shard 3, 7 images)
    seen, n_batches = [], []
    for rank in range(world):
        batches = epoch_batches(dm, rank, world)
        n_batches.append(len(batches))
        assert len(batches) == len(dm.train_dataset(rank, world))
        for batch in batches:
            assert batch["x"].dtype == torch.float16 and batch["x"].shape == (BATCH, D)
            seen += [key_of(row) for row in batch["x"]]
            assert batch["shards"] and all(name.endswith(".tar") for name in batch["shards"])
    assert len(set(n_batches)) == 1  # every rank the same count: no DDP hang
    assert len(seen) == len(set(seen))  # no duplicates
    assert set(seen) <= train
    assert len(train) - len(seen) < world * BATCH  # only the tail short of a batch per rank is dropped


def test_batch_shard_names_match_tokens(shard_dir):
    dpath, where, _ = shard_dir
    dm = make_dm(dpath, num_workers=0)
    fpaths = [str(p) for p in S.shard_fpaths(dpath, dm.manifest)]
    for batch in epoch_batches(dm, 0, 1):
        assert sorted(batch["shards"]) == sorted({fpaths[where[key_of(r)][2]] for r in batch["x"]})


def test_shuffle_mixes_images_and_is_deterministic_per_epoch(shard_dir):
    dpath, where, _ = shard_dir
    dm = make_dm(dpath, num_workers=0)
    epoch0 = epoch_batches(dm, 0, 1, epoch=0)
    again = epoch_batches(make_dm(dpath, num_workers=0), 0, 1, epoch=0)
    epoch1 = epoch_batches(dm, 0, 1, epoch=1)
    other_seed = epoch_batches(make_dm(dpath, num_workers=0, seed=1), 0, 1, epoch=0)
    flat = lambda batches: torch.cat([b["x"] for b in batches])  # noqa: E731
    assert torch.equal(flat(epoch0), flat(again))
    assert not torch.equal(flat(epoch0), flat(epoch1))
    assert not torch.equal(flat(epoch0), flat(other_seed))
    # A real token-level shuffle: an image's tokens land in several batches, and a batch holds many images;
    # the reference is the same tokens read in order (what an unshuffled stream would batch together).
    train_units = dm.data_source.units("train", dm.val_fraction)
    fpaths = [str(p) for p in S.shard_fpaths(dpath, dm.manifest)]
    in_order = sorted(
        (k for k, v in where.items() if fpaths[v[2]] in {u.name for u in train_units}),
        key=lambda k: (where[k][0], where[k][1]),
    )
    ref_batches = [in_order[i : i + BATCH] for i in range(0, len(in_order) // BATCH * BATCH, BATCH)]

    def mixing(batches: list[list[bytes]]) -> tuple[float, float]:
        batch_of = {}
        for i, keys in enumerate(batches):
            for key in keys:
                batch_of.setdefault(where[key][0], set()).add(i)
        per_image = np.mean([len(b) for b in batch_of.values()])
        per_batch = np.mean([len({where[k][0] for k in keys}) for keys in batches])
        return per_image, per_batch

    shuffled = mixing([[key_of(r) for r in b["x"]] for b in epoch0])
    sequential = mixing(ref_batches)
    assert shuffled[0] > 1.5 * sequential[0] and shuffled[1] > 1.5 * sequential[1]


def test_shuffle_buffer_is_a_permutation_and_skips(shard_dir):
    rng = np.random.default_rng(3)
    parts = [rng.standard_normal((n, D)).astype(np.float16) for n in (5, 7, 3, 9, 8)]  # 32 tokens

    def run(skip: int) -> list[torch.Tensor]:  # noqa: E306
        buffer, out = ShuffleBuffer(12, 4, np.random.default_rng(7)), []
        for slots in buffer.batches(iter(enumerate(parts)), skip):
            x = np.empty((4, D), np.float16)
            buffer.gather(slots, x)
            out.append(torch.from_numpy(x).float())
        return out

    out = run(0)
    assert len(out) == 8 and all(x.shape == (4, D) for x in out)
    ref = np.concatenate(parts).astype(np.float32)
    got = torch.cat(out).numpy()
    assert sorted(map(bytes, got)) == sorted(map(bytes, ref))
    assert not np.array_equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(run(3), out[3:])) and len(run(3)) == 5


@pytest.mark.parametrize("workers,n_done", [(2, 5), (2, 6), (2, 22), (3, 7)])
def test_resume_mid_epoch_yields_exactly_the_rest(shard_dir, workers, n_done):
    dpath, _, _ = shard_dir
    dm = make_dm(dpath, num_workers=workers)
    full = epoch_batches(dm, 0, 1, epoch=1)
    assert len(full) == 23  # uneven worker quotas: exercises the round-robin bookkeeping
    loader = TrainTokenLoader(dm.train_dataset(0, 1), num_workers=workers, epoch_fn=lambda: 1)
    iterator = iter(loader)
    for _ in range(n_done):
        next(iterator)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["batches_done"] == n_done
    del iterator
    resumed = TrainTokenLoader(dm.train_dataset(0, 1), num_workers=workers, epoch_fn=lambda: 1)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(full) - n_done
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(rest, full[n_done:]))
    assert len(list(resumed)) == len(full)  # the state applies once; the next iteration is a whole epoch


def test_loader_started_in_inference_mode_closes_outside_it(shard_dir):
    dm = make_dm(shard_dir[0])
    with torch.inference_mode():  # how Lightning runs validate / predict
        batches = iter(TokenLoader(dm.val_dataset(0, 1), num_workers=2))
        first = next(batches)
    assert first["x"].shape == (BATCH, D)
    batches.close()  # Lightning stops at len() and drops the iterator outside inference mode


@pytest.mark.parametrize("world", [1, 2, 3])
def test_val_tokens_exactly_once_across_ranks(shard_dir, world):
    dpath, _, per_shard = shard_dir
    dm = make_dm(dpath)
    _, val = split_sets(dm, per_shard)
    seen = []
    for rank in range(world):
        dataset = dm.val_dataset(rank, world)
        batches = list(TokenLoader(dataset, num_workers=2))
        assert len(batches) == len(dataset)
        seen += [key_of(row) for b in batches for row in b["x"]]
    assert len(seen) == len(set(seen)) and set(seen) == val


def test_predict_covers_every_token_once_with_ids_and_positions(shard_dir):
    dpath, where, _ = shard_dir
    dm = make_dm(dpath)
    seen = {}
    for rank in range(2):
        dataset = dm.predict_dataset(rank, 2)
        batches = list(TokenLoader(dataset, num_workers=2))
        assert len(batches) == len(dataset)
        for b in batches:
            assert b["token_positions"].dtype == torch.int64
            assert len(b["image_ids"]) == len(b["token_positions"]) == len(b["x"])
            for row, image_id, pos in zip(b["x"], b["image_ids"], b["token_positions"].tolist()):
                assert key_of(row) not in seen
                seen[key_of(row)] = (image_id, pos)
    assert seen == {k: v[:2] for k, v in where.items()}


def test_too_few_shards_for_ranks_x_workers(shard_dir):
    dm = make_dm(shard_dir[0], num_workers=4)  # 6 training shards
    with pytest.raises(ValueError, match=r"6 training shards < ranks x workers = 2 x 4 = 8.*--data.num_workers"):
        dm.train_dataset(0, 2)


def test_truncated_shard_raises_one_line_error_naming_it(shard_dir, tmp_path):
    dpath = tmp_path / "copy"
    dpath.mkdir()
    for f in shard_dir[0].iterdir():
        (dpath / f.name).write_bytes(f.read_bytes())
    dm = make_dm(dpath, val_fraction=0.0)
    bad = dpath / "shard-000001.tar"
    bad.write_bytes(bad.read_bytes()[:5000])  # cut after the datamodule checked sizes: mid-run damage
    with pytest.raises(S.ShardFormatError) as info:
        for _ in TrainTokenLoader(dm.train_dataset(0, 1), num_workers=2):
            pass
    message = str(info.value)
    assert str(bad) in message and "truncated" in message and "\n" not in message


def test_short_shard_raises_shard_format_error(shard_dir, tmp_path):
    dpath = tmp_path / "copy"
    dpath.mkdir()
    for f in shard_dir[0].iterdir():
        (dpath / f.name).write_bytes(f.read_bytes())
    dm = make_dm(dpath, num_workers=0, val_fraction=0.0)
    S.write_shard(dpath, 1, [(f"x{i}", np.zeros((TPI, D), np.float16), {}) for i in range(2)])  # 2, not 11
    with pytest.raises(
        S.ShardFormatError,
        match=r"shard-000001.json: sha256 differs from .*manifest.json: the shard "
        r"was rewritten after the manifest; run .*finalize --out",
    ):
        list(dm.predict_dataset(0, 1))
    for unit in dm.data_source.units("all", 0.0):
        unit.verify = False  # without the sidecar check, the short read itself is named
    with pytest.raises(
        S.ShardFormatError, match=r"shard-000001.tar: ends before sample \d+ of the 11 the manifest lists"
    ):
        list(dm.predict_dataset(0, 1))


def test_bad_settings_are_one_line_errors(shard_dir, tmp_path, token_shards):
    with pytest.raises(ValueError, match="--data.batch_size"):
        make_dm(shard_dir[0], batch_size=10_000).train_dataset(0, 1)
    with pytest.raises(ValueError, match="--data.shuffle_buffer_tokens=8 must be >= --data.batch_size=16"):
        make_dm(shard_dir[0], batch_size=16, shuffle_buffer_tokens=8)
    token_shards(tmp_path, [1], D)
    with pytest.raises(ValueError, match="--data.val_fraction=0.1 leaves no training shards"):
        ActivationDataModule(str(tmp_path))


class Recorder(L.LightningModule):
    """Trains a tiny linear map and records a fingerprint of every training batch, and ``x``'s dtype, device
    and pinning as it leaves the loader (before the copy to the device) and as the step gets it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(D, D)
        self.seen: list[str] = []
        self.before: set[tuple[torch.dtype, bool]] = set()  # (dtype, pinned) of x from the loader
        self.in_step: set[tuple[torch.dtype, str]] = set()  # (dtype, device type) of x in the steps

    def on_before_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        self.before.add((batch["x"].dtype, batch["x"].is_pinned()))
        return batch

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.in_step.add((batch["x"].dtype, batch["x"].device.type))
        self.seen.append(hashlib.sha1(batch["x"].cpu().numpy().tobytes()).hexdigest())
        return (self.layer(batch["x"]) - batch["x"]).pow(2).mean()

    def predict_step(self, batch: dict, batch_idx: int) -> list[tuple[str, int]]:
        self.in_step.add((batch["x"].dtype, batch["x"].device.type))
        return list(zip(batch["image_ids"], batch["token_positions"].tolist()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(tmp_path: Path, **kwargs) -> L.Trainer:
    return L.Trainer(
        **{"accelerator": "cpu", **kwargs},
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def test_lightning_epochs_resume_and_predict(shard_dir, tmp_path):
    dpath, where, _ = shard_dir
    dm = make_dm(dpath, num_workers=0)
    n = len(dm.train_dataset(0, 1))
    full = Recorder()
    trainer(tmp_path / "a", max_epochs=2, enable_checkpointing=False, limit_val_batches=0).fit(full, datamodule=dm)
    assert len(full.seen) == 2 * n and full.seen[:n] != full.seen[n:]  # a new order each epoch
    # The batch leaves the loader in the shard dtype and reaches the step as float32 of it (converted after the
    # copy to the device: on_after_batch_transfer), so the step's bytes are those of the float32 reference.
    assert full.before == {(torch.float16, False)} and full.in_step == {(torch.float32, "cpu")}
    for epoch in range(2):  # the trainer's epoch selects the order
        ref = [hashlib.sha1(b["x"].float().numpy().tobytes()).hexdigest() for b in epoch_batches(dm, 0, 1, epoch)]
        assert full.seen[epoch * n : (epoch + 1) * n] == ref
    # Interrupt epoch 1 after 3 steps (checkpoint), resume: together exactly the uninterrupted stream.
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=n + 3, save_top_k=-1)
    first = Recorder()
    trainer(tmp_path / "b", max_steps=n + 3, callbacks=[ckpt], limit_val_batches=0).fit(
        first, datamodule=make_dm(dpath, num_workers=0)
    )
    second = Recorder()
    ckpt_fpath = next((tmp_path / "ckpt").glob("*.ckpt"))
    trainer(tmp_path / "c", max_epochs=2, enable_checkpointing=False, limit_val_batches=0).fit(
        second, datamodule=make_dm(dpath, num_workers=0), ckpt_path=ckpt_fpath
    )
    assert first.seen + second.seen == full.seen
    in_order = trainer(tmp_path / "d").predict(Recorder(), datamodule=make_dm(dpath, num_workers=0))
    assert [p for batch in in_order for p in batch] == [v[:2] for v in where.values()]
    recorder = Recorder()  # the workers' batches come through the BatchRing: the same dtypes
    two_workers = trainer(tmp_path / "e").predict(recorder, datamodule=make_dm(dpath, num_workers=2))
    assert sorted(p for batch in two_workers for p in batch) == sorted(v[:2] for v in where.values())
    assert recorder.before == {(torch.float16, False)} and recorder.in_step == {(torch.float32, "cpu")}


def test_loaders_pin_for_a_gpu_and_row_sources_keep_float32(shard_dir):
    """Pinning is the loaders' flag (the datamodule sets it when the trainer's device is CUDA; pinning itself
    needs a CUDA build, see the CUDA test below); digits rows were float32 on the host already and stay so."""
    dm = make_dm(shard_dir[0])
    in_process = TokenLoader(dm.val_dataset(0, 1), num_workers=0, pin_memory=True)
    assert in_process.pin_memory  # the DataLoader pins the whole batch
    with_workers = TokenLoader(dm.val_dataset(0, 1), num_workers=2, pin_memory=True)
    assert with_workers.pin_x and not with_workers.pin_memory  # BatchRing.take copies into pinned memory
    assert not TokenLoader(dm.val_dataset(0, 1), num_workers=2).pin_x
    assert dm._pin_memory() is False  # no trainer: nothing to pin for
    digits = next(iter(ActivationDataModule("digits", batch_size=16, num_workers=0).val_dataloader()))
    assert digits["x"].dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_batches_cross_pinned_in_float16_and_train_in_float32(shard_dir, tmp_path, workers):
    dpath = shard_dir[0]
    dm = make_dm(dpath, num_workers=workers)
    recorder = Recorder()
    n = len(dm.train_dataset(0, 1))
    trainer(tmp_path, accelerator="cuda", devices=1, max_epochs=1, enable_checkpointing=False).fit(
        recorder, datamodule=dm
    )
    assert recorder.before == {(torch.float16, True)} and recorder.in_step == {(torch.float32, "cuda")}
    ref = [hashlib.sha1(b["x"].float().numpy().tobytes()).hexdigest() for b in epoch_batches(dm, 0, 1, 0)]
    assert recorder.seen == ref and len(ref) == n


def test_loader_benchmark_quick_run(capsys):
    from benchmarks import loader as module

    results = module.main(["--quick"])
    assert set(results) == {
        "raw",
        "plain",
        "workers_0",
        "workers_1",
        "workers_2",
        "workers_1_unverified",
        "workers_2_unverified",
        "verify_ratio_1",
        "verify_ratio_2",
        "reader",
    }
    assert np.isnan(results["plain"][2])  # the plain decode has no cold run
    results["plain"] = results["plain"][:2]
    assert all(np.isfinite(rate) and rate > 0 for rates in results.values() for rate in rates)
    assert "ratio" in capsys.readouterr().out
