"""Functions run on every rank of a pool. Each builds its single-device reference itself
(same model, data and seed) and returns how far the parallel run is from it."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch
import torch.distributed as dist

import polyshard as ps
from polyshard import models
from polyshard.compiler.redistribute import redistribute, to_dtensor
from polyshard.layout import Layout
from polyshard.transitions import common_axes, plan_transition
from tests.distributed.comm_counter import CommCounter


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """max |a - b| / max(max |b|, floor): the parity measure (1e-5 in fp32). ``floor``: the scale below
    which a tensor counts as zero (a parameter exact arithmetic never moves is compared on the scale of
    one optimizer step, not on the rounding noise that moved it)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def _optimizer(params, name: str):
    return torch.optim.AdamW(params, lr=1e-2) if name == "adamw" else torch.optim.SGD(params, lr=0.1)


def train_parity(mesh: str, model: str = "gpt-tiny", steps: int = 5, dtype=torch.float32, tied: bool = True,
                 accum: int = 1, optimizer: str = "adamw", batch: int = 8, copies: int = 1,
                 search: bool = False, sequence_parallel: bool = False) -> dict:
    """Train ``steps`` steps on one device and on the mesh; return the worst loss and parameter errors."""
    ps.init(mesh)
    torch.manual_seed(123)
    ref, par = (_build(model, dtype, tied) for _ in range(2))
    ref.to(ps.current_mesh().device)  # parallelize moves ``par`` there
    batches = [_batch(ref, batch, seed=s) for s in range(steps)]
    pm = ps.parallelize(par, example_inputs=_batch(ref, batch // ps.current_mesh().num_data_shards // accum, seed=0),
                        copies=copies, search=search, sequence_parallel=sequence_parallel)
    ref_opt, opt = _optimizer(ref.parameters(), optimizer), _optimizer(pm.parameters(), optimizer)
    loss_err = 0.0
    for x, y in batches:
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        lx, ly = pm.local_batch(x, y)
        total = torch.zeros((), dtype=dtype, device=ref_loss.device)
        for i, (mx, my) in enumerate(zip(lx.chunk(accum), ly.chunk(accum))):
            last = i == accum - 1
            with (pm.no_sync() if not last else contextlib.nullcontext()):
                loss = pm(mx, my) / accum
                loss.backward()
            total += loss.detach()
        if pm.grad_sync is not None:
            dist.all_reduce(total, group=pm.grad_sync.group)
            total /= pm.grad_sync.world
        opt.step()
        opt.zero_grad()
        loss_err = max(loss_err, rel_err(total, ref_loss.detach()))
    full = pm.full_state_dict()
    param_err = max(rel_err(full[k], p.detach()) for k, p in ref.named_parameters())
    layouts = {k: str(v) for k, v in pm.plan.params.items()}
    impls = {k: n.impl for k, n in pm.plan.nodes.items()}
    sequence = pm.plan.sequence_parallel
    del pm, opt
    return {"loss_err": loss_err, "param_err": param_err, "layouts": layouts, "impls": impls,
            "sequence_parallel": sequence}


def _build(model: str, dtype, tied: bool):
    torch.manual_seed(7)
    if model == "mlp":
        return models.MLPClassifier(in_features=16, hidden=32, num_classes=8).to(dtype)
    if model == "foreign":
        from tests.foreign import TinyLM
        return TinyLM().to(dtype)
    cfg = models.config(model)
    import dataclasses
    return models.GPT(dataclasses.replace(cfg, tied=tied)).to(dtype)


def _batch(model, batch: int, seed: int):
    """A batch drawn on the CPU from ``seed`` (the same on every device), placed where ``model`` is."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    if isinstance(model, models.MLPClassifier):
        dtype = next(model.parameters()).dtype
        out = torch.randn(batch, 4, 4, generator=g).to(dtype), torch.randint(0, 8, (batch,), generator=g)
    elif not hasattr(model, "cfg"):
        out = model.batch(batch, seed)
    else:
        t = model.cfg.seq_len
        out = (torch.randint(0, model.cfg.vocab_size, (batch, t), generator=g),
               torch.randint(0, model.cfg.vocab_size, (batch, t), generator=g))
    return tuple(x.to(device) for x in out)


def matmul_parity(in_strategy, out_strategy=None, steps: int = 5) -> dict:
    """An eager sharded matmul inside a training loop vs plain matmul: output, grads, params."""
    ps.init()
    mm = ps.shard(torch.matmul, in_strategy=in_strategy, out_strategy=out_strategy)
    torch.manual_seed(0)
    x = torch.randn(8, 12)
    w_ref = torch.nn.Parameter(torch.randn(12, 4))
    w = torch.nn.Parameter(w_ref.detach().clone())
    ref_opt, opt = torch.optim.AdamW([w_ref], lr=1e-2), torch.optim.AdamW([w], lr=1e-2)
    err, layout = 0.0, None
    for _ in range(steps):
        ref = x @ w_ref
        (ref ** 2).mean().backward()
        z = mm(x, w)
        layout = str(z.placements)
        (z.full_tensor() ** 2).mean().backward()
        err = max(err, rel_err(z.full_tensor().detach(), ref.detach()), rel_err(w.grad, w_ref.grad))
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    return {"err": max(err, rel_err(w.detach(), w_ref.detach())), "layout": layout}


def two_matmul_parity(steps: int = 5) -> dict:
    """Z = (X @ W) @ V with X split by rows, then V split by columns: the gather in between is ours."""
    ps.init()
    mm1 = ps.shard(torch.matmul, in_strategy=((2, 1), (1, 1)))
    mm2 = ps.shard(torch.matmul, in_strategy=((1, 1), (1, 2)))
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    ref_params = [torch.nn.Parameter(torch.randn(6, 10)), torch.nn.Parameter(torch.randn(10, 4))]
    params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    ref_opt, opt = torch.optim.AdamW(ref_params, lr=1e-2), torch.optim.AdamW(params, lr=1e-2)
    err = 0.0
    with CommCounter() as counter:
        y = mm1(x, params[0])
        z = mm2(y, params[1])
    ops = counter.ops()
    for _ in range(steps):
        ref = (x @ ref_params[0]) @ ref_params[1]
        ref.square().mean().backward()
        z = mm2(mm1(x, params[0]), params[1])
        z.full_tensor().square().mean().backward()
        err = max(err, rel_err(z.full_tensor().detach(), ref.detach()),
                  *(rel_err(p.grad, r.grad) for p, r in zip(params, ref_params)))
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    err = max(err, *(rel_err(p.detach(), r.detach()) for p, r in zip(params, ref_params)))
    return {"err": err, "forward_collectives": ops, "out": str(z.placements)}


def redistribution_bytes(mesh: str, src_spec, dst_spec, src_partial=(), dst_partial=(), shape=(8, 12),
                         all_to_all: bool = True) -> dict:
    """Bytes the planner predicts per axis vs the bytes the issued collectives send; value parity."""
    m = ps.init(mesh, op_axes=("a", "b"), allow_all_to_all=all_to_all)  # two operator axes of our own naming
    axes = m.op_axes
    src = Layout(axes, tuple(tuple(d) for d in src_spec), tuple(src_partial))
    dst = Layout(axes, tuple(tuple(d) for d in dst_spec), tuple(dst_partial))
    torch.manual_seed(0)
    full = torch.randn(shape)
    pieces = to_dtensor(full, Layout.replicated(axes, len(shape)), shape, m).redistribute(
        m.device_mesh(axes), src.with_dims(src.dims).placements()) if not src.partial else None
    if src.partial:  # each rank holds an equal share of the sum
        n = 1
        for a in src.partial:
            n *= src.axis_sizes[a]
        local = _piece(full / n, src.with_dims(src.dims, ()), m)
        pieces = to_dtensor(local, src, shape, m)
    a, b = common_axes(src, dst)
    predicted: dict[str, float] = {}
    steps = plan_transition(a, b, all_to_all)
    for step in steps:
        predicted[step.axis] = predicted.get(step.axis, 0.0) + step.bytes_sent(shape, full.element_size())
    with CommCounter() as counter:
        out = redistribute(pieces, dst, m)
    measured = counter.bytes_by_group()
    groups = {m.device_mesh(a.axes).get_group(name).group_name: name for name, _ in a.axes}
    measured_by_axis = {groups[g]: v for g, v in measured.items()}
    return {"predicted": predicted, "measured": measured_by_axis, "err": rel_err(out.full_tensor(), full),
            "steps": [s.collective for s in steps]}


def _piece(full: torch.Tensor, layout: Layout, mesh) -> torch.Tensor:
    dm = mesh.device_mesh(layout.axes)
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full, dm, layout.placements(), src_data_rank=None).to_local()


def data_parallel_collectives(bucket_bytes: int) -> dict:
    """All-reduces issued by one data-parallel backward: one per bucket, none per parameter."""
    ps.init("dp=4")
    model = _build("gpt-tiny", torch.float32, True)
    x, y = _batch(model, 8, 0)
    pm = ps.parallelize(model, example_inputs=(x[:2], y[:2]), bucket_bytes=bucket_bytes)
    lx, ly = pm.local_batch(x, y)
    loss = pm(lx, ly)
    with CommCounter() as counter:
        loss.backward()
    return {"all_reduces": counter.ops().count("all_reduce"), "buckets": len(pm.grad_sync.buckets),
            "params": len(list(pm.parameters()))}


class CumsumNet(torch.nn.Module):
    """A net with an op polyshard has no rule for (cumsum)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.out(torch.cumsum(self.fc(x), dim=1)), y)


class RepeatsNet(CumsumNet):
    """CumsumNet's products, a column-parallel one's features through repeat_interleave and repeat along the
    sequence."""

    def forward(self, x, y):
        h = self.fc(x)
        z = h.repeat_interleave(2, dim=1) + h.repeat(1, 2, 1)
        return torch.nn.functional.cross_entropy(self.out(z).mean(1), y)


class GathersNet(CumsumNet):
    """CumsumNet's products, a column-parallel one's features each reordered along the sequence by gather."""

    def __init__(self):
        super().__init__()
        self.register_buffer("order", torch.randint(0, 3, (1, 3, 16), generator=torch.Generator().manual_seed(0)))

    def forward(self, x, y):
        h = self.fc(x)
        z = torch.gather(h, 1, self.order.expand(h.shape[0], -1, -1))
        return torch.nn.functional.cross_entropy(self.out(z).mean(1), y)


class MergedHeadsNet(CumsumNet):
    """CumsumNet's products, a column-parallel one's features as two heads merged with the batch into one dim and
    summed along it in order."""

    def forward(self, x, y):
        h = self.fc(x)
        b, s = h.shape[:2]
        merged = h.view(b, s, 2, 8).transpose(1, 2).reshape(b * 2, s, 8)
        z = torch.cumsum(merged, 0).view(b, 2, s, 8).transpose(1, 2).reshape(b, s, 16)
        return torch.nn.functional.cross_entropy(self.out(z).mean(1), y)


NETS = {"cumsum": (CumsumNet, (6, 8)), "repeats": (RepeatsNet, (6, 3, 8)), "gathers": (GathersNet, (6, 3, 8)),
        "merged_heads": (MergedHeadsNet, (6, 3, 8))}


def one_step_parity(net: str, captured_rows: int | None = None) -> dict:
    """One of NETS on tp=2 against one device: polyshard's warnings, the loss and gradient errors, and the layout
    of each op's output; ``captured_rows``: captured by export (keyword inputs) at that many rows of the batch."""
    import warnings
    ps.init("tp=2")
    torch.manual_seed(0)
    make, shape = NETS[net]
    ref, par = make().double(), make().double()
    par.load_state_dict(ref.state_dict())
    x, y = torch.randn(*shape, dtype=torch.float64), torch.randint(0, 4, (6,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        example = (x, y) if captured_rows is None else {"x": x[:captured_rows], "y": y[:captured_rows]}
        pm = ps.parallelize(par, example_inputs=example)
    messages = [str(w.message) for w in caught if "polyshard" in str(w.message)]
    ref_loss, loss = ref(x, y), pm(x, y) if captured_rows is None else pm(x=x, y=y)
    ref_loss.backward(), loss.backward()
    full_grads = {k: p.grad for k, p in ref.named_parameters()}
    grad_err = 0.0
    for name, p in pm.program.named_parameters():
        layout = pm.plan.params[name]
        g = to_dtensor(p.grad, layout, layout.global_shape(p.shape), ps.current_mesh()).full_tensor()
        grad_err = max(grad_err, rel_err(g, full_grads[name]))
    return {"warnings": messages, "loss_err": rel_err(loss.detach(), ref_loss.detach()), "grad_err": grad_err,
            "outputs": {name: str(node.output) for name, node in pm.plan.nodes.items()}}


class RowsThenFeatures(torch.nn.Module):
    """Two products, pinned so that the first splits its input's rows and the second its features: the
    hidden activations move their split from dim 0 to dim 1 in between."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


def all_to_all_parity(allowed: bool, steps: int = 3) -> dict:
    """RowsThenFeatures on tp=2 with all-to-all allowed or not, against one device: losses, parameters, the
    collectives one training step issues, and the all-to-alls DTensor was asked for (gloo has none: torch
    runs each as a gather and a chunk, so the wire alone cannot tell them apart)."""
    from torch.distributed.tensor import placement_types

    asked = []
    torch_all_to_all = placement_types.shard_dim_alltoall

    def counted(*args, **kwargs):
        asked.append(args[1:3])  # (gather dim, shard dim)
        return torch_all_to_all(*args, **kwargs)

    ps.init("tp=2", allow_all_to_all=allowed)
    torch.manual_seed(0)
    ref = RowsThenFeatures().double()
    par = RowsThenFeatures().double()
    par.load_state_dict(ref.state_dict())
    ps.shard(par.fc1, in_strategy=((2, 1), (1, 1)))  # rows split, weight whole
    ps.shard(par.fc2, in_strategy=((1, 2), (1, 2)))  # features split, with the weight's in-features
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (6,), generator=g))
               for _ in range(steps)]
    pm = ps.parallelize(par, example_inputs=batches[0])
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(pm.parameters(), lr=1e-2)
    loss_err, issued = 0.0, None
    for x, y in batches:
        ref_loss = ref(x, y)
        with CommCounter() as counter, mock.patch.object(placement_types, "shard_dim_alltoall", counted):
            loss = pm(x, y)
            loss.backward()
        issued = issued or counter.ops()
        ref_loss.backward()
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
        loss_err = max(loss_err, rel_err(loss.detach(), ref_loss.detach()))
    full = pm.full_state_dict()
    return {"loss_err": loss_err, "param_err": max(rel_err(full[k], p.detach()) for k, p in ref.named_parameters()),
            "collectives": issued, "all_to_alls_per_step": len(asked) // steps}


def pinned_gpt_parity(mesh: str = "tp=2", steps: int = 5) -> dict:
    """Pins on an Embedding, a Linear (named form) and a LayerNorm (any module) are honoured; parity holds."""
    ps.init(mesh)
    ref, par = _build("gpt-tiny", torch.float64, True), _build("gpt-tiny", torch.float64, True)
    ps.shard(par.wte, in_strategy=((1, 1), (2, 1)))                          # vocabulary split
    ps.shard(par.blocks[0].mlp.fc, in_strategy=((None, None, "tp"), (None, "tp")))  # in-features split
    ps.shard(par.ln_f, in_strategy=((2, 1, 1),))                             # rows of the input split
    x, y = _batch(ref, 4, 0)
    pm = ps.parallelize(par, example_inputs=(x, y))
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(pm.parameters(), lr=1e-2)
    loss_err = 0.0
    for s in range(steps):
        x, y = _batch(ref, 4, s)
        ref_loss, loss = ref(x, y), pm(x, y)
        ref_loss.backward(), loss.backward()
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
        loss_err = max(loss_err, rel_err(loss.detach(), ref_loss.detach()))
    full = pm.full_state_dict()
    param_err = max(rel_err(full[k], p.detach()) for k, p in ref.named_parameters())
    return {"loss_err": loss_err, "param_err": param_err,
            "layouts": {k: str(v) for k, v in pm.plan.params.items()},
            "inputs": {k: {i: str(l) for i, l in pm.plan.nodes[k].inputs.items()} for k in ("blocks_0_mlp_fc", "ln_f")}}


def manual_collectives() -> dict:
    """Each collective on dp=2 x tp=2 against the same arithmetic on full tensors, values and grads."""
    mesh = ps.init("dp=2,tp=2")
    tp = mesh.coords()["tp"]
    torch.manual_seed(0)
    full = torch.randn(4, 6, dtype=torch.float64)
    mine = full.chunk(2)[tp].clone().requires_grad_()
    gathered = ps.comm.all_gather(mine, "tp", dim=0)
    (gathered * full).sum().backward()  # same loss on every tp rank
    errs = [rel_err(gathered.detach(), full), rel_err(mine.grad, full.chunk(2)[tp])]
    share = (full * (tp + 1)).requires_grad_()  # each rank holds a summand
    total = full * 3
    errs.append(rel_err(ps.comm.all_reduce(share, "tp").detach(), total))
    scattered = ps.comm.reduce_scatter(share, "tp", dim=1)
    errs.append(rel_err(scattered.detach(), total.chunk(2, dim=1)[tp]))
    scattered.sum().backward()
    errs.append(rel_err(share.grad, torch.ones_like(full)))  # all-gather of ones
    moved = ps.comm.all_to_all(full.chunk(2, dim=0)[tp].clone(), "tp", split_dim=1, concat_dim=0)
    errs.append(rel_err(moved, full.chunk(2, dim=1)[tp]))
    x = torch.randn(2, 6, dtype=torch.float64)  # differs per rank: the data axis sums across dp
    errs.append(rel_err(ps.comm.all_reduce(x, "dp"), _sum_over("dp", x, mesh)))
    # each split op asks for its DeviceMesh every step: the slices are made once and handed out again
    slices = [mesh.device_mesh(), mesh.axis_mesh("tp"), mesh.axis_mesh("dp")]
    again = [mesh.device_mesh(), mesh.axis_mesh("tp"), mesh.axis_mesh("dp")]
    return {"err": max(errs), "reused": all(a is b for a, b in zip(slices, again)),
            "names": [s.mesh_dim_names for s in slices]}


def _sum_over(axis: str, x: torch.Tensor, mesh) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=mesh.axis_mesh(axis).get_group())
    return out


def manual_pipeline() -> dict:
    """Two ranks as two stages with send/recv: loss and both stages' gradients equal one device."""
    ps.init()
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 8).double(), torch.nn.Linear(8, 2).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    ref = second(torch.tanh(first(x))).square().mean()
    ref.backward()
    ref_grads = [p.grad.clone() for p in (*first.parameters(), *second.parameters())]
    for p in (*first.parameters(), *second.parameters()):
        p.grad = None
    if dist.get_rank() == 0:
        anchor = ps.comm.send(torch.tanh(first(x)), dst=1)
        anchor.backward()
        return {"grad_err": max(rel_err(p.grad, g) for p, g in zip(first.parameters(), ref_grads[:2]))}
    h = ps.comm.recv((3, 8), src=0, dtype=torch.float64)
    loss = second(h).square().mean()
    loss.backward()
    return {"grad_err": max(rel_err(p.grad, g) for p, g in zip(second.parameters(), ref_grads[2:])),
            "loss_err": rel_err(loss.detach(), ref.detach())}


def plan_from_json_parity(edit: bool) -> dict:
    """A plan written to JSON (and optionally edited by hand) runs, with parity."""
    from polyshard.graph.capture import capture
    from polyshard.plan import Plan
    from polyshard.planner.propagate import propagate

    ps.init("tp=2")
    ref, par = _build("gpt-tiny", torch.float64, True), _build("gpt-tiny", torch.float64, True)
    x, y = _batch(ref, 4, 0)
    plan = propagate(capture(_build("gpt-tiny", torch.float64, True), (x, y)), ps.current_mesh().op_axes, print)
    text = plan.to_json()
    if edit:  # by hand: keep the first MLP whole (replicated weights, gathered input)
        import json
        raw = json.loads(text)
        replicated = {"axes": [["tp", 2]], "dims": [[], []], "partial": []}
        raw["params"]["blocks.0.mlp.fc.weight"] = raw["params"]["blocks.0.mlp.proj.weight"] = replicated
        raw["params"]["blocks.0.mlp.fc.bias"] = raw["params"]["blocks.0.mlp.proj.bias"] = {
            "axes": [["tp", 2]], "dims": [[]], "partial": []}
        for name in ("blocks_0_mlp_fc", "blocks_0_mlp_proj"):
            node = raw["nodes"][name]
            node["impl"] = "local"
            node["params"] = {"weight": replicated, "bias": {"axes": [["tp", 2]], "dims": [[]], "partial": []}}
            node["inputs"] = {k: {"axes": [["tp", 2]], "dims": [[], [], []], "partial": []} for k in node["inputs"]}
            node["output"] = {"axes": [["tp", 2]], "dims": [[], [], []], "partial": []}
        for name in ("gelu",):
            raw["nodes"][name]["inputs"] = {k: {"axes": [["tp", 2]], "dims": [[], [], []], "partial": []}
                                            for k in raw["nodes"][name]["inputs"]}
            raw["nodes"][name]["output"] = {"axes": [["tp", 2]], "dims": [[], [], []], "partial": []}
        text = json.dumps(raw)
    pm = ps.parallelize(par, example_inputs=(x, y), plan=Plan.from_json(text))
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for s in range(5):
        x, y = _batch(ref, 4, s)
        ref_loss, loss = ref(x, y), pm(x, y)
        ref_loss.backward(), loss.backward()
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    full = pm.full_state_dict()
    return {"loss_err": rel_err(loss.detach(), ref_loss.detach()),
            "param_err": max(rel_err(full[k], p.detach()) for k, p in ref.named_parameters()),
            "fc": str(pm.plan.params["blocks.0.mlp.fc.weight"])}


def tensor_parallel_collectives() -> dict:
    """All-reduces one tensor-parallel forward and its backward issue (the rules' Megatron layout)."""
    ps.init("tp=4")
    model = _build("gpt-tiny", torch.float32, True)
    x, y = _batch(model, 4, 0)
    pm = ps.parallelize(model, example_inputs=(x, y))
    with CommCounter() as forward:
        loss = pm(x, y)
    with CommCounter() as backward:
        loss.backward()
    return {"forward": forward.ops().count("all_reduce"), "backward": backward.ops().count("all_reduce"),
            "layers": model.cfg.num_layers}


def planned_bytes(model: str, mesh_text: str, sequence: int) -> dict:
    """Bytes one training step's collectives send on this rank, forward and backward, against the cost model's
    prices for the plan searched on this mesh (products slowed so that splitting them pays, as on large models):
    its forward moves and own collectives, then its gradients' way back and the whole weights' gradient sums."""
    from polyshard.cluster import Cluster
    from polyshard.graph.capture import capture
    from polyshard.planner.config import Fixed
    from polyshard.planner.cost.comm import node_backward_bytes, node_comm_bytes, weight_sum_bytes
    from polyshard.planner.search import search
    from polyshard.transitions import wire_bytes

    mesh = ps.init(mesh_text)
    world = dist.get_world_size()
    a100 = Cluster.preset(f"{world}xA100-80G")
    slow = dataclasses.replace(a100, flops_per_s=dict.fromkeys(a100.flops_per_s, 1e7), op_overhead_s=0.0,
                               split_op_overhead_s=0.0, all_to_all=mesh.cluster.all_to_all)
    meta = models.build(model, device="meta")
    plan, _ = search(meta, meta.example_inputs(1), slow, 4, fixed=Fixed.parse(f"{mesh_text},sp={sequence}"))
    built = models.build(model, seed=0)
    pm = ps.parallelize(built, example_inputs=built.example_inputs(1), plan=plan)
    batch = built.example_inputs(4)
    pm(*batch).backward()  # first calls aside
    with CommCounter() as forward:
        loss = pm(*batch)
    with CommCounter() as backward:
        loss.backward()
    gm, backend, all_to_all = capture(meta, meta.example_inputs(4)), "gloo", mesh.cluster.all_to_all
    modules, entries = dict(gm.named_modules()), plan.nodes
    predicted_forward = predicted_backward = 0.0
    for n in gm.graph.nodes:
        if n.name in entries and n.op not in ("placeholder", "get_attr"):
            sent = node_comm_bytes(n, plan, modules, 4, backend, all_to_all)
            back = [] if n.op == "output" else (node_backward_bytes(n, plan, modules, 4, backend, all_to_all)
                                                + weight_sum_bytes(n, entries[n.name], modules, 4, backend))
            predicted_forward += sum(sum(c.values()) for c in sent)
            predicted_backward += sum(sum(c.values()) for c in back)

    def issued(counter: CommCounter) -> float:  # eager all-reduces here are the vocabulary-parallel loss's, over tp
        return sum(wire_bytes(kind, nbytes, size or world, backend) for kind, _, size, nbytes in counter.calls)

    return {"forward": (issued(forward), predicted_forward), "backward": (issued(backward), predicted_backward),
            "sequence_parallel": plan.sequence_parallel, "split": sum(e.impl != "local" for e in entries.values())}
