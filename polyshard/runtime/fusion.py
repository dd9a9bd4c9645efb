"""Communication fusion: which parameters share a collective, and what the collectives of a step cost.

``comm_fusion(module, group_id)`` puts a module's parameters in fusion group ``group_id`` (as MindSpore's
``set_comm_fusion``): parameters of one group are communicated in the same buckets, and a bucket never
mixes groups. At ZeRO level 3 a group is also one gather unit (its modules' parameters gathered together).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from polyshard.errors import PolyshardError
from polyshard.buckets import cut_buckets

FUSION_ATTR = "_polyshard_fusion"


def comm_fusion(module: nn.Module, group_id: int) -> nn.Module:
    """Mark ``module`` and every module inside it as fusion group ``group_id``; a later call on an inner
    module overrides (so mark the whole model first, then its parts). Returns ``module``."""
    if type(group_id) is not int or group_id < 0:
        raise PolyshardError(f"comm_fusion group_id must be a non-negative integer, got {group_id!r}")
    for m in module.modules():
        setattr(m, FUSION_ATTR, group_id)
    return module


def fusion_group(module: nn.Module) -> int | None:
    """The fusion group ``module`` was marked with (None: unmarked)."""
    return getattr(module, FUSION_ATTR, None)


def fusion_groups(root: nn.Module) -> dict[int, int]:
    """id(parameter) -> fusion group, for the parameters of marked modules under ``root`` (the first
    module holding a shared parameter decides). Marks survive lowering: the program keeps the model's
    modules that own parameters."""
    out: dict[int, int] = {}
    for m in root.modules():
        group = fusion_group(m)
        if group is not None:
            for p in m.parameters(recurse=False):
                out.setdefault(id(p), group)
    return out


def plan_buckets(params: Sequence[nn.Parameter], bucket_bytes: int, first_bucket_bytes: int,
                 key=lambda p: None) -> list[list[nn.Parameter]]:
    """``params`` (forward order) cut into buckets in backward order, the first closed at ``first_bucket_bytes``;
    a bucket holds one ``key(p)`` only."""
    order = list(reversed(params))  # backward meets the last layers first
    cuts = cut_buckets([p.numel() * p.element_size() for p in order], [key(p) for p in order], bucket_bytes,
                       first_bucket_bytes)
    return [[order[i] for i in bucket] for bucket in cuts]


class CommStats:
    """Collectives issued and bytes handed to them, by kind, since the last :meth:`take`.

    Bytes are the size of the whole buffer a collective works on (all-reduce: the buffer; reduce-scatter:
    its input; all-gather: its output), i.e. what one rank would hold without sharding.
    """

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def record(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def take(self) -> dict[str, int]:
        """``{"comm_<kind>_calls": n, "comm_<kind>_bytes": b, ...}`` for a metrics record; starts over."""
        out = {}
        for kind in sorted(self.calls):
            out[f"comm_{kind}_calls"] = self.calls[kind]
            out[f"comm_{kind}_bytes"] = self.bytes[kind]
        self.calls, self.bytes = {}, {}
        return out

