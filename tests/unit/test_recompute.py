"""Recompute in one process: the same training as the eager model, less memory kept for backward."""

import dataclasses
import json
import warnings

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import polyshard as ps
from polyshard import models
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.graph.regions import recomputed
from polyshard.plan import RECOMPUTE_MODES, Plan
from polyshard.compiler.recompute import apply_recompute


def _batch(seed: int, rows: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, 16), generator=g), torch.randint(0, 256, (rows, 16), generator=g)


@pytest.mark.parametrize("mode, marked, num_regions", [
    ("none", None, 0), ("selective", None, 2), ("pointwise", None, 2), ("alternate", None, 2), ("half", None, 1),
    ("full", None, 2),
    ("none", "blocks.1.mlp", 1), ("selective", "blocks.0", 2),  # block 0 holds its own attention core
])
def test_training_matches_the_eager_model(mode, marked, num_regions):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps.init()
    ref, model = models.build("gpt-tiny"), models.build("gpt-tiny")
    if marked:
        ps.recompute(model.get_submodule(marked))
    pm = ps.parallelize(model, _batch(0), recompute=mode)
    regions = [n for n, _ in pm.program.named_children() if n.startswith("recompute_")]
    assert len(regions) == num_regions, regions
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(5):
        x, y = _batch(step)
        ref_loss, loss = ref(x, y), pm(x, y)
        ref_loss.backward(), loss.backward()
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
        assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0), step
    full = pm.full_state_dict()
    for name, p in ref.named_parameters():
        assert (full[name] - p).abs().max() <= 1e-5 * p.abs().max(), name


class _LiveStorages(TorchDispatchMode):
    """Weak references to the storage of every op's output. saved_tensors_hooks would miss what
    checkpoint keeps by other means (its inputs), so what stays alive after forward is counted."""

    def __init__(self):
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.refs.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return out


def _activation_bytes(mode: str) -> int:
    """Bytes of distinct storages made in one forward and still held for backward (not parameters or inputs)."""
    model = models.build("gpt-tiny")
    x, y = _batch(0)
    program = apply_recompute(capture(model, (x, y)), mode, "keep")
    owned = {StorageWeakRef(t.untyped_storage()).cdata for t in (*model.parameters(), x, y)}
    with _LiveStorages() as live:
        loss = program(x, y)
    alive = {ref.cdata: nbytes for ref, nbytes in live.refs if not ref.expired() and ref.cdata not in owned}
    loss.backward()
    return sum(alive.values())


def test_recompute_keeps_less_for_backward():
    none, selective, pointwise, alternate, half, full = (_activation_bytes(mode) for mode in RECOMPUTE_MODES)
    assert full <= 0.4 * none, (none, full)
    assert selective < none, (none, selective)
    assert full < alternate < pointwise < none, (none, pointwise, alternate, full)
    assert full < half < none, (none, half, full)


def test_pointwise_recompute_keeps_each_blocks_products_and_attention_and_reruns_the_rest():
    gm = capture(models.build("gpt-tiny"), _batch(0))
    modules = dict(gm.named_modules())
    in_block = [n for n in gm.graph.nodes if any(path.startswith("blocks.")
                                                for path, _ in (n.meta.get("nn_module_stack") or {}).values())]
    kept = {n.name for n in in_block if isinstance(modules.get(n.target), torch.nn.Linear)
            or n.target is torch.nn.functional.scaled_dot_product_attention}
    rc = recomputed(gm, "pointwise")
    assert len(kept) == 2 * 7 and rc.cached == kept  # q, k, v, output and two MLP products, attention; 2 blocks
    assert rc.rerun == {n.name for n in in_block} - kept
    assert {type(modules[n.target]) for n in in_block if n.op == "call_module" and n.name in rc.rerun} == {
        torch.nn.LayerNorm}


def test_alternate_recompute_also_reruns_every_second_product_by_a_weight_of_each_block():
    gm = capture(models.build("gpt-tiny"), _batch(0))
    modules = dict(gm.named_modules())
    rc, pointwise = recomputed(gm, "alternate"), recomputed(gm, "pointwise")
    linears = [n.name for n in gm.graph.nodes if isinstance(modules.get(n.target), torch.nn.Linear)]
    blocks = [[name for name in linears if name.startswith(f"blocks_{b}_")] for b in (0, 1)]
    assert [len(names) for names in blocks] == [6, 6], linears  # q, k, v, output, two MLP products
    rerun = {name for names in blocks for name in names[1::2]}  # k, the output's, the second MLP product
    assert rc.cached == pointwise.cached - rerun and rc.rerun == pointwise.rerun | rerun
    assert rc.watched == pointwise.watched


def test_half_recompute_reruns_every_second_block_whole():
    gm = capture(models.build("gpt-tiny"), _batch(0))
    blocks = [{n.name for n in gm.graph.nodes if any(path == f"blocks.{b}" for path, _ in
                                                     (n.meta.get("nn_module_stack") or {}).values())} for b in (0, 1)]
    rc = recomputed(gm, "half")
    assert all(blocks) and rc.rerun == blocks[1] == recomputed(gm, "full").rerun - blocks[0]
    assert not rc.cached and not rc.watched


def test_regions_watch_for_collectives_only_where_ops_may_communicate():
    gm = capture(models.build("gpt-tiny"), _batch(0))
    comms = {collectives: {m.comm for m in apply_recompute(gm, "full", "keep", collectives=collectives).children()
                           if hasattr(m, "comm")} for collectives in (True, False)}
    assert comms == {True: {"keep"}, False: {"recompute"}}  # nothing to keep without an operator axis


def test_a_recomputed_function_gives_the_same_values_and_gradients():
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def layer(x, w):
        """Two matmuls."""
        return torch.tanh(x @ w) @ w

    ref = layer(x, w).square().sum()
    (ref_grad,) = torch.autograd.grad(ref, w)
    wrapped = ps.recompute(layer, comm="recompute")
    out = wrapped(x, w).square().sum()
    (grad,) = torch.autograd.grad(out, w)
    assert wrapped.__name__ == "layer" and wrapped.__doc__ == "Two matmuls."
    assert torch.equal(out, ref) and torch.equal(grad, ref_grad)


def test_recompute_marks_and_returns_a_module():
    block = models.build("gpt-tiny").blocks[0]
    assert ps.recompute(block) is block and block._polyshard_recompute == "keep"


def test_bad_settings_are_clear_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps.init()  # parallelize asks for the mesh first: without one, that is the error, whatever ran before
    model = models.build("gpt-tiny")
    with pytest.raises(PolyshardError,
                       match="recompute must be one of 'none', 'selective', 'pointwise', 'alternate', 'half', "
                       "'full'; got 'all'"):
        ps.parallelize(model, _batch(0), recompute="all")
    with pytest.raises(PolyshardError, match="recompute_comm must be one of 'keep', 'recompute'; got 'drop'"):
        ps.parallelize(model, _batch(0), recompute_comm="drop")
    with pytest.raises(PolyshardError, match="comm must be one of 'keep', 'recompute'; got True"):
        ps.recompute(model.blocks[0], comm=True)
    with pytest.raises(PolyshardError, match="takes a module or a function, got int"):
        ps.recompute(3)
    with pytest.raises(PolyshardError, match="recompute must be one of"):
        Plan(op_axes=(), recompute="full-ish")
    with pytest.raises(PolyshardError, match="recompute must be one of"):
        apply_recompute(capture(model, _batch(0)), "everything", "keep")


def test_nothing_to_recompute_warns():
    mlp = models.MLPClassifier(in_features=16, hidden=8, num_classes=4)
    gm = capture(mlp, mlp.example_inputs())
    with pytest.warns(UserWarning, match="recompute='full' finds no blocks"):
        assert apply_recompute(gm, "full", "keep") is gm
    with pytest.warns(UserWarning, match="marks `MLPClassifier`, which runs no op of its own"):
        apply_recompute(gm, "none", "keep", {"": "keep"})


def test_plan_json_round_trips_recompute_and_old_plans_load():
    plan = Plan(op_axes=(("tp", 2),), recompute="selective", recompute_comm="recompute")
    again = Plan.from_json(plan.to_json())
    assert (again.recompute, again.recompute_comm) == ("selective", "recompute")
    old = json.loads(plan.to_json())
    del old["recompute"], old["recompute_comm"]
    loaded = Plan.from_json(json.dumps(old))
    assert (loaded.recompute, loaded.recompute_comm) == ("none", "keep")
    with pytest.raises(PolyshardError, match="recompute must be one of"):
        Plan.from_json(json.dumps(old | {"recompute": "sometimes"}))


def test_a_cpu_pays_checkpointings_bookkeeping_and_a_watching_policy_per_op_and_a_gpu_does_not():
    """On a CPU the host runs the work: each op run again pays checkpoint's bookkeeping, each op of a region whose
    policy watches ops (pointwise, or keeping collectives' results where operators are split) pays the policy."""
    from polyshard.cluster import Cluster
    from polyshard.planner.cost.overlap import op_costs
    from polyshard.planner.propagate import propagate

    model = models.build("gpt-tiny", "meta")
    gm = capture(model, model.example_inputs(1))
    extra = dict(recompute_op_overhead_s=1e-3, watched_op_overhead_s=1e-2)
    for mode, comm, tp in (("pointwise", "recompute", 1), ("full", "keep", 1), ("full", "keep", 2)):
        plan = dataclasses.replace(propagate(gm, (("tp", tp),), lambda _: None), recompute=mode, recompute_comm=comm)
        rc = recomputed(gm, mode, comm)
        watched = len(rc.watched) + (tp > 1) * len(rc.watched_if_split)
        for name, expected in (("cpu-gloo:2", 1e-3 * len(rc.rerun) + 1e-2 * watched), ("1x2xA100-80G", 0.0)):
            base = Cluster.preset(name)
            fixed = [sum(cost.overhead_s for cost in op_costs(gm, plan, cluster))
                     for cluster in (base, dataclasses.replace(base, **extra))]
            assert fixed[1] - fixed[0] == pytest.approx(expected, rel=1e-9, abs=1e-12), (mode, comm, tp, name)
    assert len(recomputed(gm, "pointwise", "recompute").watched) > 0
