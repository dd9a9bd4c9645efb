"""Strategy tuples and named specs to layouts, and the errors bad strategies get."""

import pytest
import torch

import polyshard as ps
from polyshard.errors import PolyshardError
from polyshard.planner.rules.einsum import linear_spec, matmul_spec, pin_layouts, pin_output_layout

WORLD4 = (("world", 4),)


def test_rows_of_a_on_four_devices_leave_two_copies():
    a, b = pin_layouts(matmul_spec(2, 2), ((2, 1), (1, 1)), [(8, 6), (6, 4)], WORLD4, "matmul")
    assert a.axes == (("world:0", 2), ("world:1", 2))  # repeat outer, rows inner
    assert a.dims == (("world:1",), ()) and b.is_replicated


def test_contraction_split_gives_partial_sums():
    from polyshard.planner.rules.einsum import output_layout

    spec = matmul_spec(2, 2)
    layouts = pin_layouts(spec, ((1, 4), (4, 1)), [(8, 8), (8, 4)], WORLD4, "matmul")
    out = output_layout(spec, layouts, "matmul")
    assert out.partial == ("world",) and out.dims == ((), ())


def test_rows_and_columns_use_different_axes():
    a, b = pin_layouts(matmul_spec(2, 2), ((2, 1), (1, 2)), [(8, 6), (6, 4)], WORLD4, "matmul")
    assert a.dims[0] != b.dims[1] and a.dims[0] and b.dims[1]


def test_named_spec():
    axes = (("dp", 2), ("tp", 2))
    x, w = pin_layouts(linear_spec(2, False), ((None, "tp"), (None, "tp")), [(4, 8), (6, 8)], axes, "fc")
    assert str(x) == "RS(1)" and str(w) == "RS(1)"


def test_out_strategy_counts():
    out = pin_output_layout((2, 1), (8, 4), None, WORLD4, "matmul")
    assert out.num_shards(0) == 2 and out.num_shards(1) == 1


@pytest.mark.parametrize("strategy,shapes,needle", [
    (((3, 1), (1, 1)), [(8, 6), (6, 4)], "does not divide dim 0 of size 8"),
    (((1, 1), (1, 3)), [(8, 6), (6, 6)], "does not divide the 4 devices"),
    (((2, 1),), [(8, 6), (6, 4)], "has 1 entries but the op takes 2"),
    (((2, 1, 1), (1, 1)), [(8, 6), (6, 4)], "has 3 entries but the tensor has 2 dims"),
    (((1, 2), (4, 1)), [(8, 8), (8, 4)], "into 2 and 4 slices"),
])
def test_bad_strategies_name_op_shapes_and_fix(strategy, shapes, needle):
    with pytest.raises(PolyshardError, match="`matmul`") as err:
        pin_layouts(matmul_spec(2, 2), strategy, shapes, WORLD4, "matmul")
    assert needle in str(err.value)


@pytest.mark.parametrize("bad", [(2, 1), ((0, 1), (1, 1)), ((2.5, 1), (1, 1)), "tp"])
def test_shard_rejects_malformed_strategies(bad):
    with pytest.raises(PolyshardError, match="matmul"):
        ps.shard(torch.matmul, in_strategy=bad)


def test_shard_rejects_non_callables():
    with pytest.raises(PolyshardError, match="not int"):
        ps.shard(3, in_strategy=((1,),))


def test_shard_marks_modules_for_parallelize():
    fc = torch.nn.Linear(4, 8)
    assert ps.shard(fc, ((1, 1), (2, 1))) is fc
    assert fc._polyshard_pin.in_strategy == ((1, 1), (2, 1))


def test_named_specs_must_split_shared_dims_alike():
    axes = (("tp", 2),)
    with pytest.raises(PolyshardError, match="`fc`: input 0 splits its dim 'k' on no axis but input 1 on"):
        pin_layouts(linear_spec(2, False), ((None, None), (None, "tp")), [(4, 8), (6, 8)], axes, "fc")
