"""Windows over a split image dim: how far a window op on one tile reaches into its neighbours.

Shared by the rules (which keep a split only where tiles line up) and lowering (which exchanges the halo).
A window op lines up with the tiles when every tile divides by the stride and the output is the input
over the stride, as "same" padding gives (3x3 stride 1 padding 1, 3x3 stride 2 padding 1, 1x1 stride 2,
2x2 pooling): output row ``o`` of a tile then reads input rows ``o * stride - padding`` onward, so a tile
reaches ``padding`` rows before it and ``kernel - stride - padding`` after it.
"""

from __future__ import annotations

SPLIT_DIMS = (2, 3)  # height and width of NCHW images
# Bilinear upsampling by a whole factor (align_corners=False) blends each output pixel from the input pixels
# either side of it: a tile reaches one row before it and one after (the image's edges clamp to themselves).
BILINEAR_HALO = (1, 1)


def halo(size: int, shards: int, kernel: int, stride: int, padding: int) -> tuple[int, int, int]:
    """(rows before a tile, rows after it (negative: short of its end), output rows per tile) of a window
    op on a dim of ``size`` cut in ``shards``."""
    return padding, kernel - stride - padding, size // shards // stride


def lines_up(size: int, shards: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> bool:
    """Whether each tile's windows make exactly its own output tile, from halos no wider than a tile."""
    tile = size // shards
    if dilation != 1 or size % shards or tile % stride or (size + 2 * padding - kernel) // stride + 1 != size // stride:
        return False
    before, after, _ = halo(size, shards, kernel, stride, padding)
    return before <= tile and after <= tile


def pair(v) -> tuple[int, ...]:
    """A module's int-or-pair window argument as a pair."""
    return (v, v) if isinstance(v, int) else tuple(v)
