"""Images (and per-pixel or per-image labels) from arrays on disk, each rank reading only its piece.

An image set is a ``.npy`` array of N images (N, C, H, W) with a label array beside it: (N,) classes or
(N, H, W) masks; or a folder of image files, decoded file by file and cropped to a rank's tile. Both are memory-mapped, so nothing is read until a batch asks for it; each batch draws
its images seeded (the same on every rank), and a rank reads only its rows (data parallel) and, of each
image, only its tile (a dataset strategy splitting height and width): a window of the mapping, not the
whole image then a slice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from polyshard.data.draws import SeededDraws
from polyshard.data.image_folder import is_image_folder, open_image_folder
from polyshard.data.saved_dataset import is_saved_dataset
from polyshard.errors import PolyshardError


def open_images(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The images at ``path`` (N, C, H, W) and their labels (``<stem>.labels.npy`` beside it), mapped; or a
    folder of image files (polyshard.data.image_folder), read as the same arrays, lazily."""
    if is_image_folder(path):
        return open_image_folder(path)
    if is_saved_dataset(path):
        raise PolyshardError(f"--data {path!r} is a saved `datasets` dataset, which only token models read; an image "
                             "model reads an (N, C, H, W) .npy of images or a folder of image files")
    images_path = Path(path)
    labels_path = images_path.with_name(images_path.stem + ".labels.npy")
    for p in (images_path, labels_path):
        if not p.is_file():
            raise PolyshardError(f"--data {path!r}: {p} is not a file; give an (N, C, H, W) .npy array of images "
                                 f"and its labels in {labels_path.name}, (N,) classes or (N, H, W) masks")
    images, labels = np.load(images_path, mmap_mode="r"), np.load(labels_path, mmap_mode="r")
    if images.ndim != 4:
        raise PolyshardError(f"--data {path!r} holds an array of shape {images.shape}; images are (N, C, H, W)")
    if labels.shape not in ((images.shape[0],), (images.shape[0], *images.shape[2:])):
        raise PolyshardError(f"{labels_path.name} has shape {labels.shape}; for images of shape {images.shape} "
                             f"labels are ({images.shape[0]},) classes or ({images.shape[0]}, {images.shape[2]}, "
                             f"{images.shape[3]}) masks")
    return images, labels


class ImageBatches(SeededDraws):
    """Endless (images, labels) batches of ``batch_size`` images drawn with ``seed``, the same draws on every
    rank; a rank reads its ``rows`` of each batch and, of each image, the ``tile`` (height, width slices)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, batch_size: int, seed: int,
                 rows: slice = slice(None), tile: tuple[slice, slice] = (slice(None), slice(None))) -> None:
        if batch_size < 1:
            raise PolyshardError(f"batch_size={batch_size} must be at least 1")
        self.images, self.labels, self.batch_size = images, labels, batch_size
        self.rows, self.tile = rows, tile
        super().__init__(seed)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        picks = torch.randint(len(self.images), (self.batch_size,), generator=self._generator)[self.rows].tolist()
        h, w = self.tile
        images = np.stack([self.images[i, :, h, w] for i in picks])
        labels = np.stack([self.labels[i] if self.labels.ndim == 1 else self.labels[i, h, w] for i in picks])
        return torch.from_numpy(images.astype(np.float32)), torch.from_numpy(labels.astype(np.int64))
