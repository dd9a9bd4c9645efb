"""The search's pipeline choice: stage cuts, schedule timing, and plans that only fit pipelined."""

import dataclasses
import itertools

import numpy as np
import pytest

from polyshard import models
from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.planner.cost.comm import DataSync
from polyshard.planner.pipeline import Setup, Units, best_pipeline, cost_pipeline, schedule_options
from polyshard.plan import Plan, chunks_text
from polyshard.planner.report import chosen_row, render
from polyshard.planner.config import Fixed
from polyshard.planner import search as search_module
from polyshard.planner.search import search
from polyshard.planner.split import mesh_candidates
from polyshard.planner.stages import even_partition, min_max_partition, range_sums
from polyshard.compiler.stages import pipeline_split

MiB = 2**20


def _units(seconds, activation_mib, param_numels, send_mib=0.0):
    """Hand-made units: ``seconds`` per row each (all compute), activations per row, one module of
    parameters each, and ``send_mib`` per row across every cut."""
    n = len(seconds)
    return Units(span=tuple((f"u{i}", f"u{i}") for i in range(n)), starts=tuple(f"u{i}" for i in range(n)),
                 compute_s=np.array(seconds, float), comm_s=np.zeros(n), overhead_s=np.zeros(n),
                 latency_s=np.zeros(n), forward_share=1 / 3, activation_bytes=np.array(activation_mib) * MiB,
                 rerun_bytes=np.zeros(n), transient_bytes=np.zeros(n), send_bytes=np.array([0.0] + [send_mib * MiB] * (n - 1)),
                 groups=tuple(((k,),) for k in param_numels), model_groups=tuple((k,) for k in param_numels))


def _setup(pp, rows, limit=float("inf"), send_s_per_mib=0.0):
    return Setup(pp=pp, dp=1, rows=rows, zero=0, precision="fp32", offload="none", limit=limit,
                 send=lambda b: b / MiB * send_s_per_mib, dp_sync=lambda b, groups, m, size: DataSync(0.0),
                 update_seconds=lambda numel, tensors=0: 0.0)


def test_min_max_partition_of_unequal_layers():
    # 1+1+1 | 3 beats 1+1 | 1+3; in three parts 1+1 | 1 | 3 (largest 3); ties go to the earliest cut
    assert min_max_partition(lambda banded: banded(range_sums([1, 1, 1, 3])), 4, 2) == (3.0, [3])
    assert min_max_partition(lambda banded: banded(range_sums([1, 1, 1, 3])), 4, 3) == (3.0, [1, 3])
    assert min_max_partition(lambda banded: banded(range_sums([1, 2])), 2, 3) == (float("inf"), [])


@pytest.mark.parametrize("seed", range(6))
def test_min_max_partition_matches_brute_force_with_per_part_limits(seed):
    """Random loads, and a per-part cap on a second quantity (as memory per stage): the dynamic
    program's optimum and cuts equal the best of every contiguous split (ties to the earliest cuts)."""
    rng = np.random.default_rng(seed)
    units = int(rng.integers(3, 9))
    parts = int(rng.integers(1, units + 1))
    load, size = rng.uniform(1, 5, units), rng.uniform(1, 5, units)
    caps = rng.uniform(4, 12, parts)
    prefix, mass = np.concatenate([[0], np.cumsum(load)]), np.concatenate([[0], np.cumsum(size)])

    def part_load(k, i, j):
        return np.where(mass[j] - mass[i] <= caps[k], prefix[j] - prefix[i], np.inf)

    best = (float("inf"), [])
    for cuts in itertools.combinations(range(1, units), parts - 1):
        edges = [0, *cuts, units]
        worst = max(float(part_load(k, np.array(a), np.array(b))) for k, (a, b) in enumerate(zip(edges, edges[1:])))
        if worst < best[0]:
            best = (worst, list(cuts))
    ends = np.arange(units + 1)
    mass_of, load_of = (m[ends[None, :]] - m[ends[:, None]] for m in (mass, prefix))  # [start, end]
    found = min_max_partition(lambda banded: np.where(banded(mass_of) <= caps[:, None, None], banded(load_of), np.inf),
                              units, parts)
    assert found[0] == pytest.approx(best[0])
    if np.isfinite(best[0]):
        edges = [0, *found[1], units]
        assert max(float(part_load(k, np.array(a), np.array(b)))
                   for k, (a, b) in enumerate(zip(edges, edges[1:]))) == pytest.approx(best[0])


@pytest.mark.parametrize("seed", range(8))
def test_a_pipeline_is_refused_exactly_when_no_cuts_fit(seed):
    """Random units under 1F1B and a limit near what they need: no pipeline exactly when no contiguous cuts let
    every stage hold its units and pp - s micro-batches (the greedy test before the cut program says no only
    then)."""
    rng = np.random.default_rng(seed)
    n, pp = int(rng.integers(3, 8)), int(rng.integers(2, 4))
    acts, numels = rng.uniform(1, 8, n), rng.integers(1, 8, n)  # MiB per row; x 2**16 parameters: MiB of state
    units = _units([1.0] * n, list(acts), [int(k) * 2**16 for k in numels])
    for limit_mib in np.linspace(5, 60, 12):
        found = cost_pipeline((units,), _setup(pp, 4, limit_mib * MiB), 4, "1f1b", 1)
        fits = any(all(numels[i:j].sum() + acts[i:j].sum() * (pp - k) <= limit_mib
                       for k, (i, j) in enumerate(zip((0, *cuts), (*cuts, n))))
                   for cuts in itertools.combinations(range(1, n), pp - 1))
        assert (found is not None) == fits, (limit_mib, found)


@pytest.mark.parametrize("seed", range(6))
def test_what_memory_refused_is_bounded_from_below(seed):
    """Every option memory refused or squeezed into slower cuts, that could have beaten the pipeline found (any,
    when none fits), steps no faster than the third figure best_pipeline returns: the search tries what frees
    memory while that is below the best, even where the other optimizer levels of a split lost on their bounds."""
    rng = np.random.default_rng(seed)
    n, pp, rows = int(rng.integers(4, 9)), int(rng.integers(2, 4)), 8
    units = _units(list(rng.uniform(0.5, 2.0, n)), list(rng.uniform(1, 8, n)), [int(k) * 2**16 for k in
                                                                              rng.integers(1, 8, n)])
    refusals = 0
    for limit_mib in np.linspace(10, 120, 12):
        setup = _setup(pp, rows, limit_mib * MiB)
        found, _, refused = best_pipeline((units,), setup)
        unlimited = dataclasses.replace(setup, limit=float("inf"))
        beat_s = found.step_s if found else float("inf")
        could_win = []  # options memory refused, or squeezed into slower cuts, that could beat what was found
        for option in schedule_options(n, setup.rows, setup.pp, setup.fixed):
            fitting, free = cost_pipeline((units,), setup, *option), cost_pipeline((units,), unlimited, *option)
            if (fitting is None or fitting.step_s > free.step_s * (1 + 1e-9)) and free.step_s < beat_s:
                could_win.append(free.step_s)
        assert refused <= min(could_win, default=float("inf")) * (1 + 1e-9), limit_mib
        assert (found is None) <= (refused < float("inf")), limit_mib  # nothing fits: what memory refused is told
        refusals += refused < float("inf")
    assert refusals, "memory refused nothing: the test checks nothing"


@pytest.mark.parametrize("pp, limit_mib", [(2, 48), (3, 40), (4, 40)])
def test_cuts_memory_squeezed_are_costed_however_much_they_lose(pp, limit_mib):
    """Memory moves the cuts off the fastest ones, and they lose to a step another split took: they are costed
    (not cut short as lost, which would hold at any memory), and what freeing memory may reach, the fastest
    cuts', is told beside them, so the search goes on to recompute."""
    units = _units([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], [2.0, 7.0, 1.0, 8.0, 2.0, 8.0, 1.0, 8.0],
                   [k * 2**16 for k in range(1, 9)])
    setup = dataclasses.replace(_setup(pp, 8, limit_mib * MiB), fixed=Fixed(m=8, schedule="1f1b"))
    free = cost_pipeline((units,), dataclasses.replace(setup, limit=float("inf")), 8, "1f1b", 1)
    squeezed = cost_pipeline((units,), setup, 8, "1f1b", 1)
    beat = free.step_s * 1.01  # the step to beat: the fastest cuts would, the squeezed ones do not
    assert squeezed.squeezed and squeezed.step_s > beat
    assert cost_pipeline((units,), setup, 8, "1f1b", 1, beat_s=beat) == squeezed
    found, _, refused = best_pipeline((units,), setup, beat)
    assert found.step_s == squeezed.step_s and refused <= free.step_s * (1 + 1e-12) < beat


def test_the_pick_does_not_depend_on_the_order_splits_are_tried_in(monkeypatch):
    """MT-NLG's shape on 3360 A100s (Smith et al. 2022): without recompute, memory squeezes pp=7's cuts, and they
    lose to the step pp=21 takes; recomputing the first stage's pointwise ops frees the fastest cuts, which win.
    Tried after pp=21, pp=7 must still be recomputed."""
    model = models.build("gpt:layers=105,hidden=20480,heads=128,seq=2048,vocab=51200,attention=math,dropout=0.1",
                         "meta")
    graph = capture(model, model.example_inputs(1))
    monkeypatch.setattr(search_module._Costs, "order", lambda self, meshes: list(meshes))  # as given
    meshes = [(("pp", 7), ("dp", 60), ("tp", 8)), (("pp", 21), ("dp", 20), ("tp", 8))]
    picks = [search(model, model.example_inputs(1), Cluster.preset("420x8xA100-80G"), 1920, meshes=order,
                    graph=graph, workers=1)[0].report["config"] for order in (meshes, meshes[::-1])]
    assert picks[0] == picks[1] and picks[0].startswith("dp=60,tp=8,pp=7,") and "recompute=pointwise/" in picks[0]


@pytest.mark.parametrize("pp, limit_mib", [(2, 48), (3, 40), (4, 40), (2, 40)])
def test_stage_cuts_match_brute_force_under_the_memory_limit(pp, limit_mib):
    """Unequal layers, and memory that holds pp - s micro-batches on stage s (1F1B): the cuts
    minimise the slowest stage among all cuts whose every stage fits (by brute force, each of these
    limits moves the optimum off the fastest cuts; with pp=2 under 40 MiB none fits)."""
    seconds = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    acts = [2.0, 7.0, 1.0, 8.0, 2.0, 8.0, 1.0, 8.0]  # MiB per row
    numels = [1, 2, 3, 4, 5, 6, 7, 8]  # x 2**16 parameters of 16 bytes (fp32 weight, grad, two moments): MiB
    units = _units(seconds, acts, [k * 2**16 for k in numels])
    rows = m = 8  # one row per micro-batch
    found = cost_pipeline((units,), _setup(pp, rows, limit_mib * MiB), m, "1f1b", 1)

    def parts(cuts):
        return list(zip((0, *cuts), (*cuts, 8)))

    def fits(cuts):  # stage s holds units i..j-1 and pp - s micro-batches of one row
        return all(sum(numels[i:j]) + sum(acts[i:j]) * min(m, pp - s) <= limit_mib
                   for s, (i, j) in enumerate(parts(cuts)))

    slowest = {cuts: max(sum(seconds[i:j]) for i, j in parts(cuts))
               for cuts in itertools.combinations(range(1, 8), pp - 1)}
    feasible = {cuts: t for cuts, t in slowest.items() if fits(cuts)}
    if not feasible:
        assert found is None
        return
    cuts = tuple(int(b[1:]) for b in found.boundaries)
    assert cuts in feasible and feasible[cuts] == min(feasible.values()) > min(slowest.values())
    assert max(s.forward_s + s.backward_s for s in found.stages) == pytest.approx(feasible[cuts])
    assert all(s.memory.total_bytes <= limit_mib * MiB for s in found.stages)


def _recomputed(units: Units, seconds, acts_mib) -> Units:
    """``units`` under full recompute: a forward more per unit (a third slower, a quarter of it forward), an eighth
    of the activations kept, and a unit's whole activations alive again while its backward runs."""
    return dataclasses.replace(units, compute_s=np.array(seconds) * 4 / 3, forward_share=1 / 4,
                               activation_bytes=np.array(acts_mib) * MiB / 8, rerun_bytes=np.array(acts_mib) * MiB,
                               recompute="full")


@pytest.mark.parametrize("seed", range(6))
def test_each_stage_recomputes_only_where_it_must(seed):
    """Units kept or recomputed, 1F1B, limits from loose to tight: the cuts and each stage's mode minimise the
    slowest stage over every cut and every choice of modes that fits (brute force), each stage in the fastest
    mode that fits it; modes fixed per stage are kept."""
    rng = np.random.default_rng(seed)
    n, pp, m = int(rng.integers(3, 7)), int(rng.integers(2, 4)), 4
    seconds, acts, numels = rng.uniform(1, 3, n), rng.uniform(2, 8, n), rng.integers(1, 6, n)
    kept = _units(list(seconds), list(acts), [int(k) * 2**16 for k in numels])
    modes = (kept, _recomputed(kept, seconds, acts))

    def stage(s, i, j, limit):  # (seconds, mode) of stage s holding units i..j-1 in its fastest mode that fits
        held = min(m, pp - s)
        options = [(seconds[i:j].sum(), "none", acts[i:j].sum() * held),
                   (seconds[i:j].sum() * 4 / 3, "full", acts[i:j].sum() / 8 * held + acts.max())]
        return next(((t, mode) for t, mode, a in options if numels[i:j].sum() + a <= limit), (np.inf, None))

    mixed = 0
    for limit in np.linspace(4, 40, 19):
        found = cost_pipeline(modes, _setup(pp, m, limit * MiB), m, "1f1b", 1)
        best = min((max(stage(s, i, j, limit)[0] for s, (i, j) in enumerate(zip((0, *cuts), (*cuts, n)))), cuts)
                   for cuts in itertools.combinations(range(1, n), pp - 1))
        if not np.isfinite(best[0]):
            assert found is None, limit
            continue
        cuts = [int(b[1:]) for b in found.boundaries]
        parts = list(zip((0, *cuts), (*cuts, n)))
        assert max(s.forward_s + s.backward_s for s in found.stages) == pytest.approx(best[0]), limit
        assert found.recompute == tuple(stage(s, i, j, limit)[1] for s, (i, j) in enumerate(parts))
        assert all(s.memory.total_bytes <= limit * MiB * (1 + 1e-12) for s in found.stages)
        mixed += len(set(found.recompute)) > 1
        pinned = ("full",) * (pp - 1) + ("none",)  # the user's modes, kept whatever fits faster
        fixed = cost_pipeline(modes, dataclasses.replace(_setup(pp, m, limit * MiB),
                                                         fixed=Fixed(pp=pp, recompute="/".join(pinned))),
                              m, "1f1b", 1)
        assert fixed is None or fixed.recompute == pinned
    assert mixed, "no limit mixed the modes: the test checks nothing new"


def test_two_stage_step_and_bubble_by_hand():
    """Two equal stages of 0.3 s per row, 4 rows, 10 ms to send across the cut each way. By hand,
    1F1B with 4 micro-batches: stage 0 runs F in 0.11 s (0.1 + its send), B in 0.2; stage 1 F in
    0.1, B in 0.21 (0.2 + sending the gradient back). Stepping through 0F0 0F1 0B0 0F2 0B1 0F3 0B2
    0B3 and 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3, the last action (0B3) ends at 1.55 s = (m + p - 1) x
    0.31; each stage is busy 4 x 0.31 = 1.24 s, so the bubble is 1 - 2.48 / (2 x 1.55) = 0.2."""
    units = _units([0.3, 0.3], [1.0, 1.0], [10, 10], send_mib=1.0)
    found, _, _ = best_pipeline((units,), _setup(pp=2, rows=4, send_s_per_mib=0.01))
    assert (found.schedule, found.micro_batches) == ("1f1b", 4) and found.boundaries == ("u1",)
    assert found.step_s == pytest.approx(1.55)
    assert found.bubble == pytest.approx(0.2) == pytest.approx((2 - 1) / (4 + 2 - 1))
    assert found.compute_s == pytest.approx(1.2) and found.p2p_s == pytest.approx(0.04)
    assert found.bubble_s == pytest.approx(1.55 - 1.24)
    assert [(s.forward_s, s.backward_s) for s in found.stages] == [pytest.approx((0.11, 0.2)),
                                                                   pytest.approx((0.1, 0.21))]
    # GPipe holds all 4 micro-batches on each stage (4 MiB of activations), 1F1B 2 on stage 0
    gpipe = cost_pipeline((units,), _setup(2, 4), 4, "gpipe", 1)
    assert gpipe.stages[1].memory.activations_bytes == 4 * MiB and found.stages[0].memory.activations_bytes == 2 * MiB
    # each stage also holds the gradients one backward op has alive (the largest any unit makes)
    working = dataclasses.replace(units, transient_bytes=np.array([0.0, 0.5]) * MiB)
    busy = cost_pipeline((working,), _setup(2, 4), 4, "1f1b", 1)
    assert [s.memory.activations_bytes for s in busy.stages] == [2.5 * MiB, 1.5 * MiB]


def test_an_interleaved_rank_syncs_and_steps_the_parameters_of_every_chunk_it_holds():
    """Four one-unit chunks on two ranks: rank 0 runs units 0 and 2 (10 + 30 parameters), rank 1 units 1
    and 3 (20 + 40); the gradient sync and the optimizer step are rank 1's 60 in 2 tensors, not one chunk's 40."""
    units = _units([0.1] * 4, [1.0] * 4, [10, 20, 30, 40])
    synced, stepped = [], []
    setup = dataclasses.replace(_setup(pp=2, rows=2), dp=2,
                                dp_sync=lambda b, groups, m, size: synced.append(b) or DataSync(0.0),
                                update_seconds=lambda numel, tensors=0: stepped.append((numel, tensors)) or 0.0)
    found = cost_pipeline((units,), setup, 2, "interleaved", 2)
    assert [s.rank for s in found.stages] == [0, 1, 0, 1]
    assert synced == [60 * 4] and stepped == [(60, 2)]


def test_meshes_offer_pipelines_up_to_the_blocks():
    meshes = mesh_candidates(8, blocks=2)
    assert (("pp", 2), ("dp", 2), ("tp", 2)) in meshes and (("dp", 8), ("tp", 1)) in meshes
    assert {dict(m).get("pp", 1) for m in meshes} == {1, 2} and len(meshes) == 4 + 3


def _gpt_search(limit=None, meshes=None, batch=64, fixed=Fixed()):
    model = models.build("gpt-small", "meta")
    return model, search(model, model.example_inputs(1), Cluster.preset("cpu-gloo:4"), batch, limit, meshes=meshes,
                         fixed=fixed)


def test_a_model_that_fits_only_pipelined_gets_a_consistent_pipeline_plan():
    # gpt-small at 64 rows: a whole-model split run as one micro-batch needs 7.5 MiB at the least
    # (dp=4, zero 3, full recompute: a quarter of the state, but every block's inputs for 16 rows);
    # 4 stages of one block each, with micro-batches of 4 rows, need less than 6 MiB
    limit = 6.5 * MiB
    whole = [m for m in mesh_candidates(4, blocks=4) if "pp" not in dict(m)]
    with pytest.raises(PolyshardError, match="no plan that keeps m=1 fits"):
        _gpt_search(limit, whole, fixed=Fixed(m=1))
    model, (plan, ranked) = _gpt_search(limit, [m for m in mesh_candidates(4, blocks=4) if m not in whole])
    pp, dp = dict(plan.mesh)["pp"], dict(plan.mesh)["dp"]
    chosen = next(c for c in ranked if c.describe() == plan.report["chosen"])
    assert pp > 1 and chosen.memory.total_bytes <= limit and chosen.pipeline is not None
    assert len(plan.stage_boundaries) == pp * plan.virtual_stages - 1
    assert (64 // dp) % plan.micro_batches == 0
    assert all(s.memory.total_bytes <= limit for s in chosen.pipeline.stages)
    _, split = pipeline_split(model, model.example_inputs(64 // dp), plan, pp)  # the runtime cuts where it says
    assert split.chunks == pp * plan.virtual_stages


def test_only_the_stages_that_need_it_recompute():
    # gpt-small in 6 MiB on pp=4: the first stages hold 4 and 3 micro-batches in flight under 1F1B and must
    # recompute; the last hold fewer and need not, so the pipeline runs faster than recomputing everywhere
    limit, pp4 = 6 * MiB, [(("pp", 4), ("dp", 1), ("tp", 1))]
    _, (plan, ranked) = _gpt_search(limit, pp4)
    chosen = next(c for c in ranked if c.describe() == plan.report["chosen"])
    assert plan.stage_recompute == chosen.pipeline.recompute and plan.stage_recompute[0] in ("pointwise", "full")
    assert plan.stage_recompute[-1] == "none" and plan.recompute in ("pointwise", "full")
    assert all(s.memory.total_bytes <= limit for s in chosen.pipeline.stages)
    _, (_, everywhere) = _gpt_search(limit, pp4, fixed=Fixed(recompute="full"))
    fitting = [c for c in everywhere if not c.pruned and c.memory.total_bytes <= limit]
    assert fitting and chosen.step_s < min(c.step_s for c in fitting)
    text = chosen.config().text()  # the per-stage modes in the --config spelling price the same pipeline
    assert "recompute=" + chunks_text(plan.stage_recompute) in text
    _, (again, _) = _gpt_search(limit, pp4, fixed=Fixed.parse(text))
    assert again.stage_recompute == plan.stage_recompute and again.report["config"] == text
    assert again.report["candidates"][0]["step_s"] == pytest.approx(chosen.step_s)


def test_pipeline_plan_round_trips_and_renders_its_stages():
    # 3 rows: 1 or 3 micro-batches, neither a multiple of 2 stages, so no interleaving: one cut
    model, (plan, _) = _gpt_search(meshes=[(("pp", 2), ("dp", 1), ("tp", 2))], batch=3)
    plan = dataclasses.replace(plan, model="gpt-small")
    again = Plan.from_json(plan.to_json())
    assert (again.stage_boundaries, again.schedule, again.micro_batches, again.virtual_stages, again.mesh) == \
        (plan.stage_boundaries, plan.schedule, plan.micro_batches, plan.virtual_stages, plan.mesh)
    assert len(again.stage_boundaries) == 1 and again.report == plan.report
    text = render(again)
    m, cut = plan.micro_batches, int(plan.stage_boundaries[0].split(".")[1])
    assert f"pipeline: 2 stages, schedule {plan.schedule}, {m} micro-batches" in text
    assert f"(p-1)/(m+p-1) = 1/{m + 1}" in text
    assert f"wte..blocks.{cut - 1}" in text and f"blocks.{cut}..lm_head" in text


def test_even_partition_deals_blocks_out_larger_stages_first():
    assert even_partition(8, 4) == [2, 4, 6]
    assert even_partition(70, 12) == [6, 12, 18, 24, 30, 36, 42, 48, 54, 60, 65]  # BLOOM: ten of 6, two of 5
    assert even_partition(2, 3) == []


def test_even_cuts_cost_what_the_schedule_of_those_stages_costs():
    # a heavy last unit (a language-model head): even cuts give each of 3 stages two units, so stage
    # times are 2, 2 and 5 s per micro-batch (a third forward). GPipe, 4 micro-batches, by hand: the
    # last stage starts at 2/3 + 2/3, runs 4 forwards (5/3 each) and 4 backwards (10/3 each), and the
    # last backward then crosses the two stages before it (4/3 each): 4/3 + 20/3 + 40/3 + 8/3 = 24 s
    units = _units([1, 1, 1, 1, 1, 4], [0] * 6, [1] * 6)
    even = cost_pipeline((units,), dataclasses.replace(_setup(3, 4), fixed=Fixed(cuts="even")), 4, "gpipe", 1)
    free = cost_pipeline((units,), _setup(3, 4), 4, "gpipe", 1)
    assert [s.first for s in even.stages] == ["u0", "u2", "u4"] and even.span_s == pytest.approx(24.0)
    assert free.stages[-1].first == "u5" and free.span_s < even.span_s  # the head on a stage of its own


def test_a_pipelines_strategies_price_what_its_stages_send(monkeypatch):
    """Megatron-LM's 530B layer (without dropout) on 8-way tensor parallel without sequence parallel, each layer
    recomputed with its all-reduces: priced without sends, the cheapest strategies keep whole the value between
    layers, which every stage then sends whole; the search also solves with sends priced and takes the faster
    pipeline. (With dropout, splitting it over tp pays even without sends, and both keep the value split.)"""

    model = models.build("gpt:layers=8,hidden=20480,heads=128,seq=2048,vocab=51200,attention=math,dropout=0.0",
                         device="meta")
    fixed = Fixed(dp=1, tp=8, pp=4, sp=0, mbs=1, schedule="1f1b", recompute="full", recompute_comm="recompute",
                  precision="bf16", cuts="even")

    def chosen() -> dict:
        plan, _ = search(model, model.example_inputs(1), Cluster.preset("4x8xA100-80G"), 16, fixed=fixed)
        return chosen_row(plan.report)

    priced = chosen()
    with monkeypatch.context() as m:  # sends left out of the strategies, as the plain program leaves them
        m.setattr(search_module._Costs, "solved_sending", lambda self, axes, mode, rows, mesh, precision: self.solved(
            axes, mode, rows, float("inf"), precision))
        unpriced = chosen()
    assert priced["p2p_s"] < unpriced["p2p_s"] / 4 and priced["step_s"] < unpriced["step_s"]
