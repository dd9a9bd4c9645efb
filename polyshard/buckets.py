"""How gradients are cut into communication buckets and padded for sharding: one definition for the cost
model's prediction and the runtime's buffers."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from polyshard.errors import PolyshardError

BUCKET_BYTES = 25 * 2**20  # gradients per collective (as DDP's default)
FIRST_BUCKET_BYTES = 2**20  # a small first bucket starts communication early in backward (as DDP does)


def cut_buckets(sizes_bytes: Sequence[int], keys: Sequence[Hashable], bucket_bytes: int,
                first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Indices of tensors (given in backward order) cut into buckets of about ``bucket_bytes``.

    A bucket holds tensors of one key only (a fusion group, a dtype, sharded or not); the first bucket
    closed is small so the first collective starts early. Order within a bucket follows the input.
    """
    if bucket_bytes < 1:
        raise PolyshardError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[list[int]] = []
    open_buckets: dict[Hashable, tuple[list[int], list[int]]] = {}
    for i, (size, key) in enumerate(zip(sizes_bytes, keys)):
        members, total = open_buckets.setdefault(key, ([], [0]))
        members.append(i)
        total[0] += size
        if total[0] >= (min(first_bucket_bytes, bucket_bytes) if not out else bucket_bytes):
            out.append(members)
            del open_buckets[key]
    return out + [members for members, _ in open_buckets.values()]


def bucket_count(total_bytes: float, bucket_bytes: int, first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> int:
    """How many buckets :func:`cut_buckets` makes of ``total_bytes`` in many small tensors of one key: one
    collective each."""
    first = min(first_bucket_bytes, bucket_bytes)
    return 1 + max(0, -(-int(total_bytes - first) // bucket_bytes))


def padded(numel: int, world: int) -> int:
    """Elements of a flat bucket of ``numel`` once padded so ``world`` ranks get equal shards."""
    return -(-numel // world) * world
