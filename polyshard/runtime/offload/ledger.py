"""Where bytes live: the device, the host or disk, counted so a CPU-only run shows what a GPU would hold."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

HOST = torch.device("cpu")


@dataclass
class DeviceLedger:
    """Bytes resident per (place, category). Places: "device", "host", "disk". Categories: "params" and
    "grads" (the model's), "master" (the copies the optimizer updates), "state" (the optimizer's state)."""

    bytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, place: str, category: str, nbytes: int) -> None:
        self.bytes[place, category] = self.bytes.get((place, category), 0) + nbytes

    def get(self, place: str, category: str | None = None) -> int:
        """Bytes of one category at ``place``, or of all of them when ``category`` is None."""
        return sum(n for (p, c), n in self.bytes.items() if p == place and (category is None or c == category))

    def __str__(self) -> str:
        return "\n".join(f"{place:<6} {category:<6} {n / 2**20:10.2f} MiB" for (place, category), n in sorted(self.bytes.items()))
