"""Each op's candidate strategies, enumerated once per graph and operator axes.

The op rules' decisions for every layout an op's inputs may arrive in, and every alternative a rule
offers. A stack of identical layers is enumerated as two: a node of the third layer on takes its twin's
candidates (the same position in the second layer), renamed when first read. What every recompute
mode, offload and row count of a search share is kept with them (:class:`Enumeration`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import fx, nn

from polyshard.graph.params import modules_of, parameters_of, read_whole
from polyshard.graph.twins import blocks, stripped, twins
from polyshard.layout import Axes, Layout
from polyshard.plan import NodePlan
from polyshard.planner.rules import RuleContext, decide_all
from polyshard.planner.rules.base import INPUT_LAYOUTS
from polyshard.transitions import common_axes, plan_transition


MAX_COMBOS = 64  # input-layout combinations tried per op


def candidates(gm: fx.GraphModule, op_axes: Axes,
               sequence: bool | None = None) -> tuple[dict[str, Sequence[NodePlan]], dict[str, str]]:
    """Every node's candidate strategies, in graph order, and the nodes whose came from a twin.

    A node in the third or later of a run of identical blocks takes its twin's candidates (in
    the run's second block, renamed) when its inputs may arrive in the same layouts: a 96-layer
    model is enumerated as two layers."""
    modules = modules_of(gm)
    owned = parameters_of(gm).owned
    read = read_whole(gm)
    whole = {id(p): Layout.replicated(op_axes, p.ndim) for _, p in parameters_of(gm).named if id(p) in read}
    ctx = RuleContext(op_axes, modules, {}, dict(whole), lambda msg: None, sequence,
                      gm.meta.get(INPUT_LAYOUTS, {}))
    nodes = list(gm.graph.nodes)
    table = twins(gm)
    values: dict[str, list] = {}
    out: dict[str, Sequence[NodePlan]] = {}
    copied: dict[str, str] = {}
    for node in nodes:
        inputs = node.all_input_nodes
        twin = table.get(node.name)
        if twin is not None and all(_same(values[a.name], values[b.name]) for a, b in zip(inputs, twin.all_input_nodes)):
            out[node.name] = _Renamed(out[twin.name], {b.name: a.name for a, b in zip(inputs, twin.all_input_nodes)})
            values[node.name] = values[twin.name]
            copied[node.name] = twin.name
            continue
        found: list[NodePlan] = []
        for combo in itertools.islice(itertools.product(*(values[i.name] for i in inputs)), MAX_COMBOS):
            ctx.layouts.update({i.name: v for i, v in zip(inputs, combo)})
            found += [d for d in decide_all(node, ctx)
                      if d not in found and _keeps_whole(d, owned.get(node.target, ()), whole)]
        out[node.name] = found
        values[node.name] = list({_key(d.output): d.output for d in found}.values())
    return out, copied


class _Renamed(Sequence):
    """A twin's candidates with this node's inputs in place of the twin's, each made when first read: a
    search reads one of most nodes' candidates (its pick), and of a stack of layers enumerates two."""

    def __init__(self, twin: list[NodePlan], rename: dict[str, str]):
        self._twin, self._rename, self._made = twin, rename, {}

    def __len__(self) -> int:
        return len(self._twin)

    def taking(self, name: str) -> tuple:
        """What :func:`layouts_taken` reads: the twin's layouts of its inputs this node renames ``name``, the
        last one of a candidate's where several are (as a renamed candidate keeps it)."""
        theirs = {k for k, mine in self._rename.items() if mine == name}
        return tuple(next((v for k, v in reversed(d.inputs.items()) if k in theirs), None) for d in self._twin)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        made = self._made.get(i)
        if made is not None:
            return made
        i = range(len(self))[i]  # a negative index counts from the end, one out of range raises
        if i not in self._made:
            d = self._twin[i]
            self._made[i] = NodePlan(d.impl, {self._rename[k]: v for k, v in d.inputs.items()}, d.output, d.params,
                                     d.shape_divisors)
        return self._made[i]


def layouts_taken(options: Sequence[NodePlan], name: str) -> tuple:
    """The layout each candidate takes input ``name`` in (None: as it comes), a twin's without making its own."""
    if isinstance(options, _Renamed):
        return options.taking(name)
    return tuple(d.inputs.get(name) for d in options)


def _same(a: list, b: list) -> bool:
    return a is b or a == b  # a copied node shares its twin's list: most checks end at `is`


def _key(value):
    return repr(value)


_ENUMERATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per graph: what settings share


@dataclass
class Enumeration:
    """What every recompute mode, offload and row count of one graph on one set of operator axes
    share: the candidates, each node's stand-in, the shared-parameter conflicts, the blocks that may be
    counted as their twins, and the seconds of ops, of their forwards and of moves already costed (per cluster
    and precision), which a setting changes only where it runs a node again."""

    options: dict[str, Sequence[NodePlan]]
    copied: dict[str, str]
    rep: dict[str, str]
    modules: dict[str, nn.Module]
    conflicts: list[tuple[tuple[str, int], tuple[str, int]]]
    repeats: list[Repeat]
    seconds: dict = field(default_factory=dict)
    moves: dict = field(default_factory=dict)
    forward: dict = field(default_factory=dict)
    gathers: dict = field(default_factory=dict)  # all_to_all -> :func:`gathering_pairs`


@dataclass(frozen=True)
class Repeat:
    """A block whose every node took its twin's candidates (the third and later of a run), whose values the
    model does not return and whose parameters are its own: where recompute treats each node as its twin,
    the block's terms are its twin block's, but for the edges in from the block before it.

    members and twins: node names, position by position; boundary: node -> positions of its inputs from
    outside the block that are not its twin's inputs; twin_edges: (producer, consumer) of the twin's edges
    the others map onto."""

    members: tuple[str, ...]
    twins: tuple[str, ...]
    boundary: dict[str, tuple[int, ...]]
    twin_edges: tuple[tuple[str, str], ...]


_REPEATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per graph: every operator axes asks again


def _repeats(gm: fx.GraphModule) -> list[Repeat]:
    """The blocks of ``gm`` with twins whose terms can be counted as their twin block's where every node took
    its twin's candidates (see :class:`Repeat`): none of their values, or those they read, is one the model
    returns, and no parameter of theirs was met before (a tied weight is costed on its own)."""
    found = _REPEATS.get(gm)
    if found is not None:
        return found
    twin_of, owned, seen, shares = twins(gm), parameters_of(gm).owned, set(), set()
    for n in gm.graph.nodes:
        if shares_params(n, owned, seen):
            shares.add(n.name)
        if n.op == "call_module":
            seen.update(id(p) for _, _, p in owned[n.target])
    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    returned = {u.name for u in out.all_input_nodes} if out is not None else set()
    found = _REPEATS[gm] = []
    for members in blocks(gm).values():
        names = {m.name for m in members}
        if not all(m.name in twin_of and m.name not in shares and m.name not in returned and
                   not any(u.name in returned for u in m.all_input_nodes) for m in members):
            continue
        boundary, twin_edges = {}, []
        for m in members:
            t = twin_of[m.name]
            # a value from the block maps onto its twin's; one from before block two (a rotary table) is shared
            for k, (u, v) in enumerate(zip(m.all_input_nodes, t.all_input_nodes)):
                if (u.name in names and twin_of[u.name] is v) or u is v:
                    twin_edges.append((v.name, t.name))
                else:
                    boundary.setdefault(m.name, []).append(k)
        found.append(Repeat(tuple(m.name for m in members), tuple(twin_of[m.name].name for m in members),
                             {n: tuple(ks) for n, ks in boundary.items()}, tuple(twin_edges)))
    return found


def enumerated(gm: fx.GraphModule, op_axes: Axes, sequence: bool | None) -> Enumeration:
    """:func:`candidates` and what derives from them, once per graph and operator axes (a search asks
    again for every recompute mode and offload)."""
    per_graph = _ENUMERATED.setdefault(gm, {})
    key = (op_axes, sequence)
    if key not in per_graph:
        options, copied = candidates(gm, op_axes, sequence)
        nodes, modules = list(gm.graph.nodes), modules_of(gm)
        rep = _representatives(nodes, blocks(gm), options, copied)
        per_graph[key] = Enumeration(options, copied, rep, modules,
                                      list(_shared_param_conflicts(nodes, options, rep, parameters_of(gm).owned)),
                                      [r for r in _repeats(gm) if all(m in copied for m in r.members)])
    return per_graph[key]


def covers(wide: Enumeration, narrow: Enumeration) -> bool:
    """Whether ``narrow``'s program is ``wide``'s with fewer strategies: the same stand-ins and twins, and each op's
    every strategy one ``wide`` offers it, alike but for the axes' sizes (tp=64 against tp=16)."""
    if narrow.rep != wide.rep or narrow.copied != wide.copied:
        return False
    for name, options in narrow.options.items():
        if name in narrow.copied:  # its twin's, renamed alike in both
            continue
        offered = {_sizeless(d) for d in wide.options[name]}
        if any(_sizeless(d) not in offered for d in options):
            return False
    return True


def _sizeless(d: NodePlan) -> tuple:
    """A strategy as its layouts' splits and pending sums, whatever the axes' sizes."""
    def laid(value):
        if isinstance(value, Layout):
            return value.dims, value.partial
        return tuple(map(laid, value)) if isinstance(value, tuple) else value
    return (d.impl, tuple((k, laid(v)) for k, v in d.inputs.items()), laid(d.output),
            tuple((k, laid(v)) for k, v in d.params.items()))


def shares_params(node: fx.Node, owned, seen: set[int]) -> bool:
    """Whether a parameter of ``node`` was met before (a tied weight counts its memory once)."""
    return node.op == "call_module" and any(id(p) in seen for _, _, p in owned[node.target])


def _representatives(nodes: list[fx.Node], block_nodes: dict[str, list[fx.Node]], options,
                     copied: dict[str, str]) -> dict[str, str]:
    """Each node's stand-in: the same position in the first of a run of identical blocks."""
    rep = {n.name: n.name for n in nodes}
    firsts: dict[tuple, list[fx.Node]] = {}
    for members in block_nodes.values():
        if all(m.name in copied for m in members):  # a twin's stand-in is already known
            rep.update({m.name: rep[copied[m.name]] for m in members})
            continue
        signature = tuple((m.op, stripped(m)) + tuple(_shape_key(options[m.name])) for m in members)
        first = firsts.setdefault(signature, members)
        rep.update({m.name: rep[f.name] for m, f in zip(members, first)})
    return rep


def _shape_key(decisions: list[NodePlan]) -> list[str]:
    return [repr((d.impl, list(d.inputs.values()), d.output, d.params)) for d in decisions]


def gathering_pairs(gm: fx.GraphModule, found: Enumeration,
                    all_to_all: bool) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """Pairs of neighbours' picks whose move between them takes a collective other than an all-reduce: a gather,
    a scatter, an all-to-all, or a slice of a value that needs a gradient (the gradient is gathered back).
    Ruling them out leaves Megatron-LM's tensor parallel before sequence parallel: every value between the
    split products whole on each rank, each product's partial sums all-reduced. Weights and inputs slice freely."""
    if all_to_all not in found.gathers:
        options, rep, pairs, seen = found.options, found.rep, set(), set()
        for n in gm.graph.nodes:
            for k, u in enumerate(n.all_input_nodes):
                key = (rep[u.name], rep[n.name], k)  # the edges of twin blocks alike: walked once
                if u.op in ("get_attr", "placeholder") or n.op == "output" or key in seen:
                    continue
                seen.add(key)
                grad = getattr(u.meta.get("tensor_meta"), "requires_grad", True)
                for i, o in enumerate(options[u.name]):
                    for j, d in enumerate(options[n.name]):
                        if _gathers(o.output, d.inputs.get(u.name), grad, all_to_all):
                            pairs.add(((key[0], i), (key[1], j)))
        found.gathers[all_to_all] = sorted(pairs)
    return found.gathers[all_to_all]


def _gathers(src, dst, grad: bool, all_to_all: bool) -> bool:
    if not isinstance(src, Layout) or not isinstance(dst, Layout) or src == dst:
        return False
    allowed = ("all_reduce", "slice") if not grad else ("all_reduce",)
    return any(step.collective not in allowed for step in plan_transition(*common_axes(src, dst), all_to_all))


def _keeps_whole(d: NodePlan, own, whole: dict[int, Layout]) -> bool:
    """Whether ``d`` lays out each parameter of its module (``own``) that the graph reads whole as ``whole`` has it."""
    return all(d.params.get(k, whole[id(p)]) == whole[id(p)] for k, _, p in own if id(p) in whole)


def _shared_param_conflicts(nodes, options, rep, owned):
    """Pairs of picks that would lay one shared parameter (a tied embedding) out two ways (``owned``: each module
    node's target's own parameters, :func:`parameters_of`)."""
    uses: dict[int, list[tuple[str, str]]] = {}
    for n in nodes:
        for pname, _, p in (owned[n.target] if n.op == "call_module" else ()):
            uses.setdefault(id(p), []).append((n.name, pname))
    for users in uses.values():
        for (a, pa), (b, pb) in itertools.combinations(users, 2):
            for i, da in enumerate(options[a]):
                for j, db in enumerate(options[b]):
                    if da.params.get(pa) != db.params.get(pb):
                        yield (rep[a], i), (rep[b], j)
