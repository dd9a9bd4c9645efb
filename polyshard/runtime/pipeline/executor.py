"""One train_step of a pipelined module on this rank: its chunks' forwards and backwards as the schedule
orders them, values and gradients sent rank to rank along ``pp``."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from polyshard.schedule import Action


class Step:
    """One train_step's state: each micro-batch's chunk inputs and outputs kept for backward,
    values passed between chunks of this rank, sends in flight, losses."""

    def __init__(self, pm, batch: list[tuple[torch.Tensor, ...]], scale: float):
        self.pm, self.batch, self.scale = pm, batch, scale
        self.kept: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.local: dict[tuple[int, int, bool], torch.Tensor] = {}
        self.sends: list[tuple[object, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []

    def receive(self, a: Action) -> list[torch.Tensor]:
        """What ``a`` needs from other chunks, once it is here: their values for a forward, the
        gradients of this chunk's outputs for a backward."""
        split = self.pm.split
        if a.kind == "F":
            return [self._recv(k, a.micro, grad=False) for k in split.received(a.chunk)]
        return [self._recv(k, a.micro, grad=True) for k in split.sent(a.chunk) if split.edges[k].grad]

    def forward(self, c: int, i: int, received: list[torch.Tensor]) -> None:
        split = self.pm.split
        out = self.pm.chunks[str(c)](*(self.batch[j][i] for j in split.inputs[c]), *received)
        if c == split.chunks - 1:
            self.losses.append(out.detach().to(split.loss_dtype))
            zero = self.pm.zero
            out = ((zero.scale_loss(out) if zero is not None else out) * (self.scale / self.pm.plan.micro_batches),)
        else:
            for k, t in zip(split.sent(c), out):
                self._send(k, i, t, grad=False)
        self.kept[(c, i)] = (received, list(out))

    def backward(self, c: int, i: int, grads: list[torch.Tensor]) -> None:
        split, pm = self.pm.split, self.pm
        received, outs = self.kept.pop((c, i))
        if c == split.chunks - 1:
            pairs = [(outs[0], None)]
        else:
            pairs = list(zip([t for k, t in zip(split.sent(c), outs) if split.edges[k].grad], grads))
        sync = pm.syncing and i == pm.plan.micro_batches - 1  # all-reduce over dp during the chunk's last backward
        with contextlib.nullcontext() if sync or pm.grad_sync is None else pm.grad_sync.no_sync():
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        for k, t in zip(split.received(c), received):
            if split.edges[k].grad:
                self._send(k, i, t.grad if t.grad is not None else torch.zeros_like(t), grad=True)

    def _peer(self, k: int) -> int | None:
        """The rank at the other end of edge ``k`` from this one (None: both chunks are this rank's)."""
        e, pp = self.pm.split.edges[k], self.pm.mesh.pp
        if e.src % pp == e.dst % pp:
            return None
        return self.pm.mesh.stage_rank((e.src if e.dst % pp == self.pm.mesh.stage else e.dst) % pp)

    def _tag(self, k: int, i: int, grad: bool) -> int:
        return (k * self.pm.plan.micro_batches + i) * 2 + grad

    def _send(self, k: int, i: int, t: torch.Tensor, grad: bool) -> None:
        if isinstance(t, AsyncCollectiveTensor):
            t = t.wait()
        t = t.detach().to(self.pm.split.edges[k].dtype).contiguous()  # a mask stays fp32 under bf16
        peer = self._peer(k)
        if peer is None:
            self.local[(k, i, grad)] = t
        else:
            self.sends.append((dist.isend(t, peer, tag=self._tag(k, i, grad)), t))

    def _recv(self, k: int, i: int, grad: bool) -> torch.Tensor:
        e, peer = self.pm.split.edges[k], self._peer(k)
        if peer is None:
            t = self.local.pop((k, i, grad))
        else:
            t = torch.empty(e.shape, dtype=e.dtype, device=self.pm.mesh.device)
            dist.recv(t, peer, tag=self._tag(k, i, grad))
        return t.requires_grad_() if e.grad and not grad else t

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
