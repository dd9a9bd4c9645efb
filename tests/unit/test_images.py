"""Image arrays on disk: seeded draws, each rank reading only its rows and its tile, resumable."""

import numpy as np
import pytest
import torch

from polyshard.data.images import ImageBatches, open_images
from polyshard.data.synthetic_images import SyntheticImages
from polyshard.errors import PolyshardError
from polyshard.layout import Layout
from polyshard.mesh import Mesh


class _Recording(np.ndarray):
    """An array that records the windows read from it."""

    reads: list

    def __getitem__(self, index):
        self.reads.append(index)
        return np.asarray(super().__getitem__(index))


def _image_set(tmp_path, masks: bool = True):
    g = np.random.default_rng(0)
    np.save(tmp_path / "train.npy", g.standard_normal((10, 3, 16, 16)).astype(np.float32))
    np.save(tmp_path / "train.labels.npy", g.integers(0, 3, (10, 16, 16) if masks else (10,)))
    return str(tmp_path / "train.npy")


def test_a_rank_reads_only_its_rows_and_its_tile(tmp_path):
    images, labels = open_images(_image_set(tmp_path))
    whole_x, whole_y = next(ImageBatches(images, labels, 4, seed=5))
    mesh = Mesh((("dp", 2), ("h", 2), ("w", 2)), ("dp",), "cpu", rank=7)  # dp 1, h 1, w 1
    tile = mesh.piece(Layout((("h", 2), ("w", 2)), ((), (), ("h",), ("w",))), (4, 3, 16, 16))[2:]
    recording = np.asarray(images).view(_Recording)
    recording.reads = []
    x, y = next(ImageBatches(recording, labels, 4, seed=5, rows=slice(2, 4), tile=tile))
    assert torch.equal(x, whole_x[2:4, :, 8:, 8:]) and torch.equal(y, whole_y[2:4, 8:, 8:])
    read = [np.empty((16, 16))[r[2:]].size * 3 for r in recording.reads]
    assert len(read) == 2 and sum(read) == 2 * 3 * 8 * 8  # two images, a quarter of each


def test_draws_are_seeded_and_resume_where_they_stood(tmp_path):
    images, labels = open_images(_image_set(tmp_path, masks=False))
    a, b = ImageBatches(images, labels, 3, seed=1), ImageBatches(images, labels, 3, seed=1)
    next(a)
    saved = a.position()
    expected = [next(a) for _ in range(2)]
    next(b)
    b.seek(saved)
    for (x, y), (ex, ey) in zip((next(b) for _ in range(2)), expected):
        assert torch.equal(x, ex) and torch.equal(y, ey) and y.shape == (3,)
    assert not torch.equal(next(ImageBatches(images, labels, 3, seed=2))[0], next(ImageBatches(images, labels, 3,
                                                                                               seed=1))[0])


@pytest.mark.parametrize("images,labels,message", [
    ((10, 16, 16), (10,), r"shape \(10, 16, 16\); images are \(N, C, H, W\)"),
    ((10, 3, 16, 16), (10, 8, 8), r"labels are \(10,\) classes or \(10, 16, 16\) masks"),
    ((10, 3, 16, 16), None, "train.labels.npy"),
])
def test_what_cannot_be_an_image_set_is_refused(tmp_path, images, labels, message):
    np.save(tmp_path / "train.npy", np.zeros(images, dtype=np.float32))
    if labels is not None:
        np.save(tmp_path / "train.labels.npy", np.zeros(labels, dtype=np.int64))
    with pytest.raises(PolyshardError, match=message):
        open_images(str(tmp_path / "train.npy"))


@pytest.mark.parametrize("per_pixel", [True, False])
def test_generated_images_are_made_tile_by_tile_as_the_whole_image(per_pixel):
    """Each rank computes only its rows and tile, and they are the whole batch's block; the same seed draws the
    same images, and a saved position continues the sequence."""
    whole = SyntheticImages(32, 3, 4, seed=7, per_pixel=per_pixel)
    tile = SyntheticImages(32, 3, 4, seed=7, per_pixel=per_pixel, rows=slice(2, 4), tile=(slice(16, 32), slice(8, 24)))
    for _ in range(2):
        (x, y), (tx, ty) = next(whole), next(tile)
        assert torch.equal(tx, x[2:4, :, 16:32, 8:24])
        assert torch.equal(ty, y[2:4, 16:32, 8:24] if per_pixel else y[2:4])
    assert set(y.unique().tolist()) <= {0, 1, 2} and (len(y.unique()) > 1)
    saved = whole.position()
    after = next(whole)
    again = SyntheticImages(32, 3, 4, seed=7, per_pixel=per_pixel)
    again.seek(saved)
    assert all(torch.equal(a, b) for a, b in zip(next(again), after))


def _folder(tmp_path, masks: bool) -> tuple[str, np.ndarray, np.ndarray]:
    """A folder of PNG files (and the arrays they hold): classes in subfolders, or images/ beside masks/."""
    from PIL import Image

    g = np.random.default_rng(1)
    pixels = g.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    labels = g.integers(0, 3, (6, 16, 16) if masks else (6,))
    root = tmp_path / "set"
    for i, image in enumerate(pixels):
        folder = root / ("images" if masks else f"class{labels[i]}")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{i:02d}.png")
        if masks:
            (root / "masks").mkdir(exist_ok=True)
            Image.fromarray(labels[i].astype(np.uint8)).save(root / "masks" / f"{i:02d}.png")
    if not masks:  # the folders list images class by class
        order = np.argsort(labels, kind="stable")
        pixels, labels = pixels[order], labels[order]
    return str(root), pixels.transpose(0, 3, 1, 2).astype(np.float32) / 127.5 - 1.0, labels


@pytest.mark.parametrize("masks", [True, False])
def test_an_image_folder_reads_as_its_arrays_a_tile_at_a_time(tmp_path, masks):
    """Files decoded one by one and cropped to the rank's tile: the same batches as the arrays they hold."""
    path, pixels, labels = _folder(tmp_path, masks)
    images, found = open_images(path)
    assert images.shape == (6, 3, 16, 16) and found.shape == labels.shape
    tile = (slice(8, 16), slice(0, 8))
    folder = ImageBatches(images, found, 4, seed=2, rows=slice(2, 4), tile=tile)
    arrays = ImageBatches(pixels, labels, 4, seed=2, rows=slice(2, 4), tile=tile)
    for _ in range(2):
        (x, y), (ax, ay) = next(folder), next(arrays)
        assert x.shape == (2, 3, 8, 8) and torch.allclose(x, ax) and torch.equal(y, ay)


def test_an_image_folder_that_does_not_hold_an_image_set_is_refused(tmp_path):
    from PIL import Image

    (tmp_path / "empty").mkdir()
    with pytest.raises(PolyshardError, match="holds no class folders"):
        open_images(str(tmp_path / "empty"))
    root = tmp_path / "mixed" / "cats"
    root.mkdir(parents=True)
    Image.new("RGB", (16, 16)).save(root / "a.png")
    Image.new("RGB", (8, 16)).save(root / "b.png")
    images, labels = open_images(str(tmp_path / "mixed"))
    with pytest.raises(PolyshardError, match="b.png is RGB 8x16; every image is RGB 16x16"):
        next(ImageBatches(images, labels, 8, seed=0))


@pytest.mark.parametrize("marker", ["state.json", "dataset_dict.json"])
def test_a_saved_dataset_is_not_taken_for_an_image_folder(tmp_path, marker):
    (tmp_path / marker).write_text("{}")
    with pytest.raises(PolyshardError, match="is a saved `datasets` dataset, which only token models read"):
        open_images(str(tmp_path))
