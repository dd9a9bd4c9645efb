"""plan_transition / wire_bytes / transition_bytes: pure planning, no process group."""

import itertools
import random

import pytest

from polyshard.errors import PolyshardError
from polyshard.layout import Layout, collapse, refine
from polyshard.transitions import PAIRWISE, Step, common_axes, plan_transition, transition_bytes, wire_bytes
from tests.unit.layout_cases import all_layouts

TP4 = (("tp", 4),)
DP_TP = (("dp", 2), ("tp", 2))
FP32 = 4


def kinds(steps):
    return [(s.collective, s.axis) for s in steps]


# -- the table, one row at a time (one axis of 4 ranks, an 8 x 12 fp32 tensor) ----------


def test_partial_to_replicated_is_all_reduce():
    src = Layout(TP4, ((), ()), ("tp",))
    dst = Layout.replicated(TP4, 2)
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("all_reduce", "tp")]
    assert steps[0].before == src and steps[0].after == dst
    # each rank holds a full 8x12 fp32 summand = 384 bytes. A ring all-reduce is a
    # reduce-scatter (send 3 of 4 chunks of 96 bytes = 288) then an all-gather (another 288).
    assert steps[0].bytes_sent((8, 12), FP32) == 576
    assert transition_bytes(src, dst, (8, 12), FP32) == {"tp": 576}


def test_partial_to_shard_is_reduce_scatter():
    src = Layout(TP4, ((), ()), ("tp",))
    dst = Layout(TP4, (("tp",), ()))
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("reduce_scatter", "tp")]
    assert steps[0].after == dst
    # 384-byte summand cut in 4 chunks of 96; each rank sends the 3 chunks it does not keep.
    assert steps[0].bytes_sent((8, 12), FP32) == 288
    # the same on dim 1
    dst1 = Layout(TP4, ((), ("tp",)))
    assert kinds(plan_transition(src, dst1)) == [("reduce_scatter", "tp")]


def test_shard_to_replicated_is_all_gather():
    src = Layout(TP4, (("tp",), ()))
    dst = Layout.replicated(TP4, 2)
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("all_gather", "tp")]
    assert steps[0].after == dst
    # each rank holds a 2x12 fp32 shard = 96 bytes and must reach 3 other ranks: 3 * 96.
    assert steps[0].bytes_sent((8, 12), FP32) == 288


def test_shard_to_other_dim_is_all_to_all():
    src = Layout(TP4, (("tp",), ()))
    dst = Layout(TP4, ((), ("tp",)))
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("all_to_all", "tp")]
    assert steps[0].after == dst
    # 2x12 shard (96 bytes) cut into 4 column blocks of 24 bytes; 3 go to the other ranks.
    assert steps[0].bytes_sent((8, 12), FP32, backend="nccl") == 72
    # gloo has no all-to-all: the whole 96-byte shard is gathered to 3 ranks.
    assert steps[0].bytes_sent((8, 12), FP32, backend="gloo") == 288
    assert steps[0].bytes_sent((8, 12), FP32) == 288  # gloo is the default


def test_without_all_to_all_a_split_moving_dims_is_gathered_then_sliced():
    src, dst = Layout(TP4, (("tp",), ())), Layout(TP4, ((), ("tp",)))
    steps = plan_transition(src, dst, all_to_all=False)
    assert kinds(steps) == [("all_gather", "tp"), ("slice", "tp")] and steps[-1].after == dst
    # on a network with all-to-all, forbidding it costs the gather's 3 x 96 bytes instead of 3 x 24
    assert transition_bytes(src, dst, (8, 12), FP32, "nccl", all_to_all=False) == {"tp": 288}
    assert transition_bytes(src, dst, (8, 12), FP32, "nccl") == {"tp" + PAIRWISE: 72}  # sent to each rank apart


def test_replicated_to_shard_is_slice():
    src = Layout.replicated(TP4, 2)
    dst = Layout(TP4, ((), ("tp",)))
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("slice", "tp")]
    assert steps[0].after == dst
    assert steps[0].bytes_sent((8, 12), FP32) == 0
    assert transition_bytes(src, dst, (8, 12), FP32) == {"tp": 0}


def test_same_layout_plans_nothing():
    lay = Layout(DP_TP, (("tp",), ()), ("dp",))
    assert plan_transition(lay, lay) == []
    assert transition_bytes(lay, lay, (4, 4), FP32) == {}


# -- several axes -----------------------------------------------------------------------


def test_two_axis_split_gathered_innermost_first():
    src = Layout(DP_TP, (("dp", "tp"), ()))
    dst = Layout.replicated(DP_TP, 2)
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("all_gather", "tp"), ("all_gather", "dp")]
    assert steps[0].after.dims == (("dp",), ())
    # 8x4 fp32 over 4 ranks: 2x4 shard = 32 bytes, gathered over tp (2 ranks): 1 * 32.
    # then a 4x4 shard = 64 bytes gathered over dp (2 ranks): 1 * 64.
    # total 96 = 128 bytes wanted - 32 held, as each rank must receive (and by symmetry send).
    assert [s.bytes_sent((8, 4), FP32) for s in steps] == [32, 64]
    assert transition_bytes(src, dst, (8, 4), FP32) == {"tp": 32, "dp": 64}


def test_inner_split_moves_to_other_dim_keeping_outer():
    src = Layout(DP_TP, (("dp", "tp"), ()))
    dst = Layout(DP_TP, (("dp",), ("tp",)))
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("all_to_all", "tp")]
    # 8x4 fp32: the 2x4 shard (32 bytes) is cut into 2 column blocks; one (16 bytes) is sent.
    assert steps[0].bytes_sent((8, 4), FP32, backend="nccl") == 16


def test_split_moves_from_outer_to_inner_position():
    # tp alone splits dim 0 (rank (d, t) holds half t); the target nests it inside dp
    # (rank (d, t) holds quarter 2d + t), so tp's pieces must be regathered and recut.
    src = Layout(DP_TP, (("tp",), ()))
    dst = Layout(DP_TP, (("dp", "tp"), ()))
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("all_gather", "tp"), ("slice", "dp"), ("slice", "tp")]
    assert steps[0].after.is_replicated
    assert steps[1].after.dims == (("dp",), ())
    # 8x4 fp32: the 4x4 half (64 bytes) gathered over 2 ranks sends 64; slices send nothing.
    assert transition_bytes(src, dst, (8, 4), FP32) == {"tp": 64, "dp": 0}


def test_split_moves_from_inner_to_outer_position():
    src = Layout(DP_TP, (("dp", "tp"), ()))
    dst = Layout(DP_TP, (("tp",), ()))
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("all_gather", "tp"), ("all_gather", "dp"), ("slice", "tp")]
    assert steps[-1].after == dst


def test_partial_reduced_before_gathering():
    src = Layout(DP_TP, ((), ("tp",)), ("dp",))
    dst = Layout(DP_TP, (("dp",), ()))
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("reduce_scatter", "dp"), ("all_gather", "tp")]
    # 8x8 fp32: the 8x4 summand (128 bytes) reduce-scattered over 2 ranks sends half, 64;
    # the result, a 4x4 shard (64 bytes), gathered over tp's 2 ranks sends 64 more.
    assert transition_bytes(src, dst, (8, 8), FP32) == {"dp": 64, "tp": 64}


def test_partial_kept_when_target_keeps_it():
    src = Layout(DP_TP, (("tp",), ()), ("dp",))
    dst = Layout(DP_TP, ((), ("tp",)), ("dp",))
    steps = plan_transition(src, dst)
    assert kinds(steps) == [("all_to_all", "tp")]
    assert steps[0].after.partial == ("dp",)


def test_target_partial_missing_in_source_is_an_error():
    src = Layout(DP_TP, (("tp",), ()))
    dst = Layout(DP_TP, (("tp",), ()), ("dp",))
    with pytest.raises(PolyshardError, match=r"partial sums on \['dp'\]"):
        plan_transition(src, dst)
    with pytest.raises(PolyshardError, match="partial sums"):
        transition_bytes(src, dst, (4, 4), FP32)


def test_mismatched_axes_or_rank_is_an_error():
    with pytest.raises(PolyshardError, match="different axes or ranks"):
        plan_transition(Layout.replicated(DP_TP, 2), Layout.replicated(TP4, 2))
    with pytest.raises(PolyshardError, match="different axes or ranks"):
        plan_transition(Layout.replicated(DP_TP, 2), Layout.replicated(DP_TP, 3))


# -- wire bytes -------------------------------------------------------------------------


def test_wire_bytes_formulas():
    # a 2x6 fp32 shard is 48 bytes; groups of 4 ranks.
    # all-gather: my 48 bytes must reach the 3 others: 3 * 48.
    assert wire_bytes("all_gather", 48, 4) == 144
    # ring all-reduce: reduce-scatter 3 of 4 chunks of 12 (36), then all-gather 36 more.
    assert wire_bytes("all_reduce", 48, 4) == 72
    # reduce-scatter: 3 of 4 chunks of 12 bytes leave.
    assert wire_bytes("reduce_scatter", 48, 4) == 36
    # all-to-all (nccl): keep one 12-byte block, send the other three.
    assert wire_bytes("all_to_all", 48, 4, backend="nccl") == 36
    # slicing a replicated tensor sends nothing.
    assert wire_bytes("slice", 48, 4) == 0
    # a group of one sends nothing for any collective.
    for c in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "slice"):
        assert wire_bytes(c, 48, 1) == 0


def test_gloo_all_to_all_counts_as_all_gather():
    # gloo has no all-to-all: the 48-byte shard goes whole to 3 ranks, as an all-gather.
    assert wire_bytes("all_to_all", 48, 4, backend="gloo") == 144
    assert wire_bytes("all_to_all", 48, 4) == 144
    # nccl all-to-all of 100 bytes over 5 ranks: 4 blocks of 20 leave.
    assert wire_bytes("all_to_all", 100, 5, backend="nccl") == 80
    # other collectives are the same on either backend: ring all-reduce of 100 over 5 = 160.
    assert wire_bytes("all_reduce", 100, 5, backend="nccl") == 160
    assert wire_bytes("all_reduce", 100, 5, backend="gloo") == 160


def test_step_bytes_use_the_before_layout_and_the_axis_size():
    axes = (("dp", 2), ("tp", 3))
    before = Layout(axes, (("dp",), ("tp",)))
    after = Layout(axes, (("dp",), ()))
    # 4x6 fp16 split 2 ways on rows and 3 on columns: 2x2 shard = 8 bytes; gathered over
    # tp's 3 ranks: 2 * 8.
    assert Step("all_gather", "tp", before, after).bytes_sent((4, 6), 2) == 16


def test_transition_bytes_across_different_matrices():
    # src: 4 ranks in one axis splitting rows; dst: 2 x 2 with the inner axis splitting rows.
    # Common matrix tp:0 (2) x tp:1 (2); src splits rows on (tp:0, tp:1), dst on (tp:1,)
    # alone, so tp:1 must move outward: gather tp:1, gather tp:0, slice tp:1.
    src = Layout(TP4, (("tp",), ()))
    dst = Layout((("rep", 2), ("i", 2)), (("i",), ()))
    a, b = common_axes(src, dst)
    assert a.dims == (("tp:0", "tp:1"), ())
    assert b.dims == (("tp:1",), ())
    # 8x4 fp32: the 2x4 shard (32 bytes) gathered over 2 ranks sends 32 on tp:1; the 4x4
    # result (64 bytes) gathered over 2 ranks sends 64 on tp:0; the final slice sends 0.
    assert transition_bytes(src, dst, (8, 4), FP32) == {"tp:1": 32, "tp:0": 64}


def test_transition_bytes_sums_over_axes():
    axes = (("a", 2), ("b", 2), ("c", 2))
    src = Layout(axes, (("a",), ("b",)), ("c",))
    dst = Layout.replicated(axes, 2)
    # 8x8 fp32, a splits rows and b columns: 4x4 local = 64 bytes, a pending sum on c.
    # all-reduce c (2 ranks): 2 * 1/2 * 64 = 64. gather a: 64. then 8x4 = 128, gather b: 128.
    assert kinds(plan_transition(src, dst)) == [("all_reduce", "c"), ("all_gather", "a"), ("all_gather", "b")]
    assert transition_bytes(src, dst, (8, 8), FP32) == {"c": 64, "a": 64, "b": 128}


# -- every layout pair over a 3-axis matrix ---------------------------------------------

AXES3 = (("a", 2), ("b", 3), ("c", 2))


def _role(lay, axis):
    """('P',), ('R',) or ('S', dim, position within the dim's splits)."""
    if axis in lay.partial:
        return ("P",)
    for d, names in enumerate(lay.dims):
        if axis in names:
            return ("S", d, names.index(axis))
    return ("R",)


def _check_plan(src, dst):
    steps = plan_transition(src, dst)
    assert (steps == []) == (src == dst)
    if steps:
        assert steps[0].before == src
        assert steps[-1].after == dst
    for prev, nxt in zip(steps, steps[1:]):
        assert prev.after == nxt.before
    names = [n for n, _ in src.axes]
    for s in steps:
        assert s.before != s.after, s
        for n in names:
            if n != s.axis:
                assert _role(s.before, n) == _role(s.after, n), (s, n)
        old, new = _role(s.before, s.axis), _role(s.after, s.axis)
        if s.collective in ("all_gather", "all_to_all"):
            # only the innermost split of a dim can be removed in one collective
            assert old[0] == "S" and old[2] == len(s.before.dims[old[1]]) - 1, s
        if s.collective in ("slice", "all_to_all", "reduce_scatter"):
            # and a new split can only be added innermost
            assert new[0] == "S" and new[2] == len(s.after.dims[new[1]]) - 1, s
        expect = {
            "all_reduce": ("P", "R"),
            "reduce_scatter": ("P", "S"),
            "all_gather": ("S", "R"),
            "all_to_all": ("S", "S"),
            "slice": ("R", "S"),
        }[s.collective]
        assert (old[0], new[0]) == expect, s
        if s.collective == "all_to_all":
            assert old[1] != new[1], s
    # each axis is removed at most once and placed at most once
    for n in names:
        assert sum(s.axis == n for s in steps) <= 2
    # exactly the partial sums the target drops are reduced
    reduced = {s.axis for s in steps if s.collective in ("all_reduce", "reduce_scatter")}
    assert reduced == set(src.partial) - set(dst.partial)
    return steps


def test_every_pair_of_2d_layouts_plans_to_target():
    layouts = all_layouts(AXES3, 2)
    assert len(layouts) == 64
    planned = 0
    for src, dst in itertools.product(layouts, repeat=2):
        if set(dst.partial) <= set(src.partial):
            _check_plan(src, dst)
            planned += 1
        else:
            with pytest.raises(PolyshardError):
                plan_transition(src, dst)
    # per axis, 4 source roles x 4 target roles, less the 3 where only the target is partial
    assert planned == 13 ** 3


def test_sampled_pairs_of_3d_layouts_plan_to_target():
    rng = random.Random(1234)
    layouts = all_layouts(AXES3, 3)
    assert len(layouts) == 125
    for _ in range(600):
        src, dst = rng.choice(layouts), rng.choice(layouts)
        dst = dst.with_dims(dst.dims, [p for p in dst.partial if p in src.partial])
        _check_plan(src, dst)


def test_every_pair_across_refinable_matrices():
    a_axes = (("x", 2), ("y", 6))
    b_axes = (("u", 4), ("v", 3))
    _, _, spans_b = refine(a_axes, b_axes)
    for src in all_layouts(a_axes, 2):
        for dst in all_layouts(b_axes, 2):
            a, b = common_axes(src, dst)
            assert a.axes == b.axes == (("x", 2), ("y:0", 2), ("y:1", 3))
            if not set(b.partial) <= set(a.partial):
                with pytest.raises(PolyshardError):
                    plan_transition(a, b)
                continue
            steps = _check_plan(a, b)
            if steps:
                assert collapse(steps[-1].after, b_axes, spans_b) == dst
