"""A folder of image files as an image set, each rank decoding only its rows' files and cropping its tile.

Two layouts, as torchvision's ImageFolder and common segmentation sets keep them:
``ROOT/<class>/<file>`` (a class per image, the classes in sorted order) and ``ROOT/images/<name>`` beside
``ROOT/masks/<name>`` (a class per pixel, the mask's pixel values). Images are square RGB files any format
Pillow reads; they look like the arrays of polyshard.data.images to its batches (N, C, H, W), read lazily.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from polyshard.data.saved_dataset import is_saved_dataset
from polyshard.errors import PolyshardError

SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp"}


def is_image_folder(path: str) -> bool:
    return Path(path).is_dir() and not is_saved_dataset(path)


def open_image_folder(path: str) -> tuple[FolderImages, np.ndarray | FolderMasks]:
    """The images under ``path`` and their labels: class indices, or masks read like the images."""
    root = Path(path)
    if (root / "images").is_dir() and (root / "masks").is_dir():
        files = _files(root / "images", path)
        masks = [root / "masks" / f.name for f in files]
        missing = [m.name for m in masks if not m.is_file()]
        if missing:
            raise PolyshardError(f"--data {path!r}: masks/ lacks {', '.join(missing[:3])}; each image needs its mask "
                                 "of the same name")
        images = FolderImages(files, path)
        return images, FolderMasks(masks, images.shape, path)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise PolyshardError(f"--data {path!r} holds no class folders; give ROOT/<class>/<image> (a class per "
                             "image) or ROOT/images/ beside ROOT/masks/ (a class per pixel)")
    files, labels = [], []
    for k, name in enumerate(classes):
        found = _files(root / name, path)
        files += found
        labels += [k] * len(found)
    return FolderImages(files, path), np.array(labels, dtype=np.int64)


def _files(folder: Path, path: str) -> list[Path]:
    found = sorted(f for f in folder.iterdir() if f.suffix.lower() in SUFFIXES)
    if not found:
        raise PolyshardError(f"--data {path!r}: {folder.name}/ holds no image files ({', '.join(sorted(SUFFIXES))})")
    return found


class FolderImages:
    """Image files as an (N, 3, H, W) float array in [-1, 1]: ``images[i, :, rows, cols]`` decodes file ``i``
    and crops it to those rows and columns."""

    ndim = 4

    def __init__(self, files: list[Path], path: str) -> None:
        self.files = files
        with Image.open(files[0]) as first:
            width, height = first.size
        self.shape = (len(files), 3, height, width)
        self.path = path

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index) -> np.ndarray:
        i, _, rows, cols = index
        with Image.open(self.files[i]) as image:
            if image.size != (self.shape[3], self.shape[2]) or image.mode != "RGB":
                raise PolyshardError(f"--data {self.path!r}: {self.files[i].name} is {image.mode} "
                                     f"{image.size[0]}x{image.size[1]}; every image is RGB "
                                     f"{self.shape[3]}x{self.shape[2]}, as the first is")
            tile = image.crop(_box(rows, cols, self.shape))
        return np.asarray(tile, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1.0


class FolderMasks:
    """Mask files as an (N, H, W) array of classes: ``masks[i, rows, cols]`` decodes mask ``i``, cropped."""

    ndim = 3

    def __init__(self, files: list[Path], image_shape: tuple[int, ...], path: str) -> None:
        self.files, self.path = files, path
        self.shape = (len(files), *image_shape[2:])

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index) -> np.ndarray:
        i, rows, cols = index if isinstance(index, tuple) else (index, slice(None), slice(None))
        with Image.open(self.files[i]) as mask:
            if mask.size != (self.shape[2], self.shape[1]) or mask.mode not in ("L", "P", "I"):
                raise PolyshardError(f"--data {self.path!r}: mask {self.files[i].name} is {mask.mode} "
                                     f"{mask.size[0]}x{mask.size[1]}; masks are one class per pixel (mode L or P), "
                                     "the size of their images")
            return np.asarray(mask.crop(_box(rows, cols, (0, 0, *self.shape[1:]))), dtype=np.int64)


def _box(rows: slice, cols: slice, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    top, bottom, _ = rows.indices(shape[2])
    left, right, _ = cols.indices(shape[3])
    return left, top, right, bottom
