"""A stack of identical layers is captured with two of them and the rest stamped from the second.

torch.export runs every layer's Python; for an 80-layer model that is most of the capture's time, while
layers of the same code and configuration give the same ops on the same shapes. So the model is exported
with its first two layers (the second is the one whose inputs come from a layer), the second layer's
nodes are checked to repeat the first's, and copies of them, renamed to layers 2..N-1, are chained on.
Layers count as identical when their modules, shapes and settings are (an index, ``layer_idx``, aside);
code that branches on that index unlike layers 0 and 1 do (only layer 7 differs, say) is not detected.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import fx, nn

KEEP = 2  # layers exported: the first, and one fed by a layer


@dataclass(frozen=True)
class Stack:
    """A ModuleList at ``path`` of ``count`` layers of the same code and configuration."""

    path: str
    count: int

    def layer(self, i: int) -> str:
        return f"{self.path}.{i}"

    def rename(self, name: str, i: int, source: int = 1) -> str:
        """``name`` under layer ``source`` as the same name under layer ``i`` (other names as they are)."""
        old = self.layer(source)
        return self.layer(i) + name[len(old):] if name == old or name.startswith(old + ".") else name


def find_stack(model: nn.Module) -> Stack | None:
    """The largest ModuleList of 3 or more layers that differ in nothing but their index and weights."""
    found = [(sum(p.numel() for p in m.parameters()), name, len(m)) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and name and len(m) > KEEP and _alike(m)]
    return Stack(*max(found)[1:]) if found else None


def _alike(layers: nn.ModuleList) -> bool:
    """Every layer is layer 0 again: the same modules, tensor shapes and settings, but for an index."""
    first = [(name, type(m), _tensors(m), settings_of(m)) for name, m in layers[0].named_modules()]
    for i, layer in enumerate(layers):
        mods = list(layer.named_modules())
        if len(mods) != len(first):
            return False
        for (name, kind, tensors, settings), (other, m) in zip(first, mods):
            mine = settings_of(m)
            if (name != other or kind is not type(m) or tensors != _tensors(m) or mine.keys() != settings.keys()
                    or not all(_same_setting(v, settings[k], i) for k, v in mine.items())):
                return False
    return True


def _tensors(m: nn.Module) -> tuple:
    return tuple((n, t.shape, t.dtype, t.requires_grad) for n, t in
                 [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)])


def settings_of(m: nn.Module) -> dict:
    """A module's settings: its attributes that are neither modules nor tensors, polyshard's marks among them (a pin,
    which keeps the module one call, or a recompute mode)."""
    return {k: v for k, v in vars(m).items() if (not k.startswith("_") or k.startswith("_polyshard_"))
            and k != "training" and not isinstance(v, (nn.Module, torch.Tensor))}


def _same_setting(mine, first, i: int) -> bool:
    """Layer ``i``'s setting is layer 0's: one object (a shared config, whose repr is long), or printed alike, or
    the layer's own index (0 in layer 0)."""
    if mine is first:
        return True
    text, first_text = repr(mine), repr(first)
    return text == first_text or (first_text == "0" and text == str(i))


def first_layers(model: nn.Module, stack: Stack) -> nn.Module:
    """A copy of ``model`` whose stack holds only its first KEEP layers; the model itself is untouched
    (modules along the path are copied, everything else, weights included, is shared)."""
    top = copy.copy(model)
    top._modules = dict(model._modules)
    parent, *_, last = [top, *stack.path.split(".")]
    for name in stack.path.split(".")[:-1]:
        child = copy.copy(parent._modules[name])
        child._modules = dict(child._modules)
        parent._modules[name] = child
        parent = child
    parent._modules[last] = nn.ModuleList(list(parent._modules[last])[:KEEP])
    return top


def stamp(graph: fx.Graph, stack: Stack, model: nn.Module, attrs: dict) -> bool:
    """Chain copies of layer 1's nodes, as layers 2..count-1, after it; False (graph untouched) unless
    layer 1 repeats layer 0 node for node and nothing after the stack reads layer 0."""
    first, second = ([n for n in graph.nodes if n.op != "get_attr" and _in_layer(n, stack, i)] for i in range(KEEP))
    shared = _shared_sizes(first, second)
    first = [n for n in first if n not in shared]
    if not _repeats(first, second, stack, graph, shared):
        return False
    index0, index1 = {n: k for k, n in enumerate(first)}, {n: k for k, n in enumerate(second)}
    position = {n: k for k, n in enumerate(graph.nodes)}
    owned = sorted({a for n in second for a in n.all_input_nodes
                    if a.op == "get_attr" and stack.rename(a.target, 2) != a.target}, key=position.__getitem__)
    after = list(dict.fromkeys(u for n in second for u in n.users if u not in index1))
    previous, anchor, weights_end = second, second[-1], owned[-1] if owned else None
    for i in range(KEEP, stack.count):
        env: dict[fx.Node, fx.Node] = {}
        for a in owned:  # this layer's weights read outside its modules, after the layer before's, in their order
            with graph.inserting_after(weights_end):
                env[a] = weights_end = graph.get_attr(stack.rename(a.target, i))
            env[a].meta = dict(a.meta)
            attrs[env[a].target] = _fetch(model, env[a].target)
        block: list[fx.Node] = []
        for node in second:
            with graph.inserting_after(anchor):
                new = graph.node_copy(node, lambda a: block[index1[a]] if a in index1 else
                                      previous[index0[a]] if a in index0 else env.get(a, a))
            if new.op == "call_module":
                new.target = stack.rename(node.target, i)
                attrs[new.target] = model.get_submodule(new.target)
            new.meta = {**node.meta, "nn_module_stack": {
                k: (stack.rename(path, i), kind) for k, (path, kind) in node.meta.get("nn_module_stack", {}).items()}}
            block.append(new)
            anchor = new
        previous = block
    for user in after:  # what followed the stack now follows its last layer
        for k, node in enumerate(second):
            user.replace_input_with(node, previous[k])
    return True


def _in_layer(node: fx.Node, stack: Stack, i: int) -> bool:
    layer = stack.layer(i)
    return any(path == layer or path.startswith(layer + ".")
               for path, _ in (node.meta.get("nn_module_stack") or {}).values())


def _shared_sizes(first: list[fx.Node], second: list[fx.Node]) -> set[fx.Node]:
    """Layer 0's size arithmetic on sizes from before the stack (the batch's) that layer 1 reads too: export
    records an expression once and every later layer reads it there, as if it came before the stack."""
    inside, shared = set(first), set()
    for n in first:
        if isinstance(n.meta.get("val"), (int, torch.SymInt)) and \
                all(a not in inside or a in shared for a in n.all_input_nodes):
            shared.add(n)
    read = {a for n in second for a in n.all_input_nodes}
    return {n for n in shared if n in read or any(u in shared for u in n.users)}


def _repeats(first: list[fx.Node], second: list[fx.Node], stack: Stack, graph: fx.Graph,
             shared: set[fx.Node]) -> bool:
    """Layer 1 is layer 0 again: contiguous (but for the ``shared`` sizes), op for op, reading layer 0 where
    layer 0 read what came before the stack, its own weights where layer 0 read its, the same other inputs; and
    nothing after the stack reads layer 0."""
    if not first or len(first) != len(second):
        return False
    nodes = list(graph.nodes)
    start, end = nodes.index(first[0]), nodes.index(second[-1])
    if [n for n in nodes[start:end + 1] if n not in shared] != [*first, *second]:
        return False
    index0, index1 = {n: k for k, n in enumerate(first)}, {n: k for k, n in enumerate(second)}

    def same(x, y) -> bool:
        if isinstance(x, str) and isinstance(y, str):
            return stack.rename(x, 1, source=0) == y
        return x == y

    for a, b in zip(first, second):
        if a.op != b.op or not same(a.target, b.target) or len(a.all_input_nodes) != len(b.all_input_nodes):
            return False
        if fx.node.map_arg((a.args, a.kwargs), lambda _: None) != fx.node.map_arg((b.args, b.kwargs), lambda _: None):
            return False  # the same constants (sizes, dims, dtypes) in the same places
        for x, y in zip(a.all_input_nodes, b.all_input_nodes):
            if y in index1:
                ok = index0.get(x) == index1[y]
            elif y in index0:
                ok = x not in index0 and x not in index1
            elif x.op == y.op == "get_attr":
                ok = same(x.target, y.target)
            else:
                ok = x is y
            if not ok:
                return False
    return all(u in index0 or u in index1 for n in first for u in n.users)


def _fetch(model: nn.Module, target: str):
    module, _, name = target.rpartition(".")
    return getattr(model.get_submodule(module), name)
