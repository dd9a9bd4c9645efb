"""Counts the collectives that actually run, and the bytes each rank sends, by process group."""

from __future__ import annotations

from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from polyshard.transitions import wire_bytes

_COLLECTIVES = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
}


class CommCounter(TorchDispatchMode):
    """Records every functional collective: (kind, group name, group size, input bytes)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and name == "allreduce_":  # eager dist.all_reduce (data parallel)
            group = args[1]
            self.calls.append(("all_reduce", "eager", 0,
                               sum(t.numel() * t.element_size() for t in args[0])))
        elif func.namespace == "_c10d_functional" and name in _COLLECTIVES:
            group = args[-1]
            size = _resolve_process_group(group).size()
            self.calls.append((_COLLECTIVES[name], group, size, args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))

    def ops(self) -> list[str]:
        return [c[0] for c in self.calls]

    def bytes_by_group(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, group, size, nbytes in self.calls:
            if not size:  # eager collectives: counted, not sized
                continue
            out[group] = out.get(group, 0.0) + wire_bytes(kind, nbytes, size, backend="nccl")
        return out
