"""Op implementations that lowering substitutes: sharded module calls and vocabulary-parallel loss."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from polyshard.compiler.redistribute import redistribute, to_dtensor
from polyshard.layout import Layout
from polyshard.mesh import Mesh

# Calls that skip functional_call's parameter swapping for the common modules.
DIRECT_CALLS = {
    nn.Linear: lambda m, p, x: F.linear(x, p["weight"], p.get("bias")),
    nn.Embedding: lambda m, p, x: F.embedding(x, p["weight"], m.padding_idx, m.max_norm, m.norm_type,
                                              m.scale_grad_by_freq, m.sparse),
}


class ShardedModule(nn.Module):
    """Runs ``module`` on DTensors made from this rank's pieces; hands back its piece of the output."""

    def __init__(self, module: nn.Module, param_layouts: dict[str, Layout], in_layouts: list[Layout],
                 out_layout: Layout, mesh: Mesh):
        super().__init__()
        self.module = module
        self.param_layouts = param_layouts
        self.in_layouts = in_layouts
        self.out_layout = out_layout
        self.mesh = mesh
        self.call = DIRECT_CALLS.get(type(module), lambda m, p, *a: functional_call(m, p, a))

    def forward(self, *args):
        params = {name: to_dtensor(p, self.param_layouts[name], self.param_layouts[name].global_shape(p.shape), self.mesh)
                  for name, p in self.module.named_parameters(recurse=False)}
        tensors = iter(self.in_layouts)
        dargs = [self._wrap(a, next(tensors)) if isinstance(a, torch.Tensor) else a for a in args]
        out = redistribute(self.call(self.module, params, *dargs), self.out_layout, self.mesh, async_op=True).to_local()
        # DTensor may hand back a strided piece (a transposed matmul); eager code expects a contiguous one.
        # A pending collective's result is contiguous already: it is left unwaited, to overlap later work.
        return out if out.is_contiguous() else out.contiguous()

    def _wrap(self, local: torch.Tensor, layout: Layout):
        if isinstance(local, DTensor):  # wrapped once for all the split ops that take it
            return local
        return to_dtensor(local, layout, layout.global_shape(local.shape), self.mesh)


class ShardedFunction:
    """A function run on DTensors, like :class:`ShardedModule` (for pinned functions in a graph)."""

    def __init__(self, fn, in_layouts: list[Layout], out_layout: Layout, mesh: Mesh, name: str):
        self.fn, self.in_layouts, self.out_layout, self.mesh = fn, in_layouts, out_layout, mesh
        self.__name__ = f"sharded_{name}"

    def __call__(self, *args, **kwargs):
        layouts = iter(self.in_layouts)
        dargs = []
        for a in args:
            if isinstance(a, torch.Tensor):
                l = next(layouts)
                a = a if isinstance(a, DTensor) else to_dtensor(a, l, l.global_shape(a.shape), self.mesh)
            dargs.append(a)
        return redistribute(self.fn(*dargs, **kwargs), self.out_layout, self.mesh).to_local()


class VocabParallelCrossEntropy:
    """Mean cross-entropy of logits split over classes, never gathering them (Megatron's method).

    torch's loss_parallel needs backward inside its context; this is an ordinary autograd op.
    """

    def __init__(self, layout: Layout, mesh: Mesh):
        axes = layout.dims[1]
        sub = mesh.device_mesh(layout.axes)[axes]
        self.group = (sub._flatten() if len(axes) > 1 else sub).get_group()
        coords = [sub.get_local_rank(a) for a in axes]
        index = 0
        for a, c in zip(axes, coords):
            index = index * layout.axis_sizes[a] + c
        self.shard_index = index
        self.__name__ = "vocab_parallel_cross_entropy"

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, **defaults) -> torch.Tensor:
        """Takes F.cross_entropy's arguments; the rule admits only their defaults besides ignore_index."""
        return vocab_parallel_cross_entropy(logits, target, self.shard_index, self.group, ignore_index)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, shard_index: int,
                                 group: dist.ProcessGroup, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of this rank's ``shard_index``-th slice of the classes, the slices spread over ``group``."""
    return _VocabCE.apply(logits, target, shard_index, group, ignore_index)


class _VocabCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, shard_index, group, ignore_index):
        local_v = logits.size(1)
        logits_max = logits.detach().amax(dim=1)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits.detach() - logits_max.unsqueeze(1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=1)
        local_target = target - shard_index * local_v
        mine = (local_target >= 0) & (local_target < local_v)
        safe = local_target.clamp(0, local_v - 1)
        picked = shifted.gather(1, safe.unsqueeze(1)).squeeze(1) * mine
        both = torch.stack([sum_exp, picked])
        dist.all_reduce(both, group=group)
        valid = target != ignore_index
        count = valid.sum().clamp(min=1)
        losses = (both[0].log() - both[1]) * valid
        softmax = exp / both[0].unsqueeze(1)
        ctx.save_for_backward(softmax, safe, mine & valid, valid, count)
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, safe, hit, valid, count = ctx.saved_tensors
        g = softmax * valid.unsqueeze(1)
        g.scatter_add_(1, safe.unsqueeze(1), -hit.unsqueeze(1).to(g.dtype))
        return g * (grad / count), None, None, None, None
