"""Image sources: folder, webdataset tars and bundled samples; bad images are skipped, not fatal."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import skimage.data
import torch
import xxhash
from PIL import Image
from torch.utils.data import DataLoader

from feature_extraction.images import SAMPLE_NAMES, ImageDataset, ImageRecord, collate_images, list_images

SIZE = 24


def preprocess(image: Image.Image) -> torch.Tensor:
    """A small deterministic transform, so decoded pixels can be compared exactly."""
    resized = np.asarray(image.resize((SIZE, SIZE), Image.BILINEAR), dtype=np.float32)
    return torch.from_numpy(resized).permute(2, 0, 1) / 255


def photo_bytes(name: str, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(getattr(skimage.data, name)()).convert("RGB").save(buffer, format=fmt)
    return buffer.getvalue()


def reference_pixels(data: bytes) -> torch.Tensor:
    return preprocess(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.fixture
def folder(tmp_path):
    """Two class folders of photos (PNG and JPEG), plus a corrupt, a truncated and an empty file."""
    root = tmp_path / "imagenet"
    files = {
        "zebra/astronaut.png": photo_bytes("astronaut", "PNG"),
        "zebra/nested/coffee.jpg": photo_bytes("coffee", "JPEG"),
        "zebra/broken.jpg": np.random.default_rng(0).bytes(500),
        "apple/chelsea.JPEG": photo_bytes("chelsea", "JPEG"),
        "apple/rocket.png": photo_bytes("rocket", "PNG"),
        "apple/truncated.jpg": photo_bytes("camera", "JPEG")[:2000],
        "apple/empty.png": b"",
        "apple/notes.txt": b"not an image",
    }
    for relative, data in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
    (root / "empty_class").mkdir()
    return root, files


def test_folder_records(folder) -> None:
    root, files = folder
    records = list_images(str(root))
    class_names = sorted(["apple", "empty_class", "zebra"])  # all sub-folders, as ImageFolder
    expected = sorted(r for r in files if not r.endswith(".txt"))
    assert [r.image_id for r in records] == expected
    for record in records:
        class_name = record.image_id.split("/")[0]
        assert record.label == class_names.index(class_name)
        assert record.class_name == class_name
        assert record.source == str(root / record.image_id)


def test_flat_folder_has_no_labels(tmp_path) -> None:
    for name in ["b", "a"]:
        (tmp_path / f"{name}.png").write_bytes(photo_bytes("coins", "PNG"))
    records = list_images(str(tmp_path))
    assert [(r.image_id, r.label) for r in records] == [("a.png", None), ("b.png", None)]


def test_images_beside_class_folders_are_ignored_with_a_warning(folder) -> None:
    root, files = folder
    (root / "stray.png").write_bytes(files["apple/rocket.png"])
    with pytest.warns(UserWarning, match="ignored"):
        records = list_images(str(root))
    assert "stray.png" not in [r.image_id for r in records]


def test_folder_decoding_and_failures(folder) -> None:
    root, files = folder
    records = list_images(str(root))
    dataset = ImageDataset(records, preprocess)
    bad = {"zebra/broken.jpg", "apple/truncated.jpg", "apple/empty.png"}
    for i, record in enumerate(records):
        index, pixels, note = dataset[i]
        assert index == i
        if record.image_id in bad:
            assert pixels is None and "Error" in note  # the reason, for the manifest's skipped list
        else:
            torch.testing.assert_close(pixels, reference_pixels(files[record.image_id]), rtol=0, atol=0)
            assert note == xxhash.xxh3_64_hexdigest(files[record.image_id])  # the file's bytes


def test_workers_match_main_process(folder) -> None:
    root, _ = folder
    dataset = ImageDataset(list_images(str(root)), preprocess)

    def run(n_workers: int):
        loader = DataLoader(dataset, batch_size=3, num_workers=n_workers, collate_fn=collate_images)
        ok, pixels, failed = [], [], []
        for batch_ok, batch_pixels, batch_failed, hashes, reasons in loader:
            assert len(hashes) == len(batch_ok) and len(reasons) == len(batch_failed)
            ok += batch_ok
            failed += batch_failed
            if batch_pixels is not None:
                assert batch_pixels.shape == (len(batch_ok), 3, SIZE, SIZE)
                pixels.append(batch_pixels)
        return ok, torch.cat(pixels), failed

    ok0, pixels0, failed0 = run(0)
    ok2, pixels2, failed2 = run(2)
    assert ok0 == ok2 and failed0 == failed2
    assert sorted(dataset.records[i].image_id for i in failed0) == sorted(
        ["zebra/broken.jpg", "apple/truncated.jpg", "apple/empty.png"]
    )
    torch.testing.assert_close(pixels0, pixels2, rtol=0, atol=0)


def write_tar(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def tar_dir(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    contents = {
        "train-000001.tar": {
            "img002.jpg": photo_bytes("astronaut", "JPEG"),
            "img002.cls": b"7",
            "img001.png": photo_bytes("coffee", "PNG"),
            "img001.cls": b" 3\n",
            "img001.json": b"{}",
        },
        "train-000000.tar": {
            "dir/img000.webp": photo_bytes("rocket", "WEBP"),
            "bad.jpg": np.random.default_rng(1).bytes(300),
            "bad.cls": b"1",
        },
    }
    for name, members in contents.items():
        write_tar(shards / name, members)
    (shards / "README.md").write_text("ignored")
    return shards, contents


def test_tar_records_and_decoding(tar_dir) -> None:
    shards, contents = tar_dir
    records = list_images(str(shards))
    ids = [r.image_id for r in records]
    assert ids == ["train-000000/bad", "train-000000/dir/img000", "train-000001/img001", "train-000001/img002"]
    assert [r.label for r in records] == [1, None, 3, 7]
    dataset = ImageDataset(records, preprocess)
    for i, record in enumerate(records):
        _, pixels, note = dataset[i]
        if record.image_id.endswith("bad"):
            assert pixels is None
        else:
            data = contents[f"{record.image_id.split('/')[0]}.tar"][record.member]
            torch.testing.assert_close(pixels, reference_pixels(data), rtol=0, atol=0)
            assert note == xxhash.xxh3_64_hexdigest(data)  # the member's bytes
    # One tar file works as a source too, and workers read the same bytes.
    assert [r.image_id for r in list_images(str(shards / "train-000001.tar"))] == ids[2:]
    loader = DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=collate_images)
    batches = list(loader)
    assert [i for ok, *_ in batches for i in ok] == [1, 2, 3]
    assert [i for _, _, failed, *_ in batches for i in failed] == [0]


def test_tar_bad_label_and_unreadable_tar(tmp_path) -> None:
    write_tar(tmp_path / "a.tar", {"x.jpg": photo_bytes("moon", "JPEG"), "x.cls": b"cat"})
    with pytest.raises(ValueError, match="x.cls"):
        list_images(str(tmp_path))
    (tmp_path / "a.tar").write_bytes(np.random.default_rng(2).bytes(1000))
    with pytest.raises(ValueError, match="a.tar"):
        list_images(str(tmp_path))


def test_samples() -> None:
    records = list_images("samples")
    assert [r.image_id for r in records] == sorted(SAMPLE_NAMES)
    assert len(records) >= 10
    dataset = ImageDataset(records, preprocess)
    for i, record in enumerate(records):
        _, pixels, note = dataset[i]
        array = getattr(skimage.data, record.image_id)()
        expected = preprocess(Image.fromarray(array).convert("RGB"))  # grey photos become RGB
        torch.testing.assert_close(pixels, expected, rtol=0, atol=0)
        assert note == xxhash.xxh3_64_hexdigest(np.ascontiguousarray(array).tobytes())


def test_bad_sources(tmp_path) -> None:
    with pytest.raises(ValueError, match="does_not_exist"):
        list_images(str(tmp_path / "does_not_exist"))
    (tmp_path / "notes.txt").write_text("no images here")
    with pytest.raises(ValueError, match="holds no images"):
        list_images(str(tmp_path))


def test_collate_all_failed() -> None:
    ok, pixels, failed, hashes, reasons = collate_images([(4, None, "OSError: a"), (5, None, "OSError: b")])
    assert ok == [] and pixels is None and failed == [4, 5] and hashes == []
    assert reasons == ["OSError: a", "OSError: b"]
    record = ImageRecord("x", "/nonexistent.png", None)
    index, pixels, why = ImageDataset([record], preprocess)[0]
    assert (index, pixels) == (0, None) and why.startswith("FileNotFoundError")
