"""Layout: construction, printing, shapes, validation, and device-matrix refinement."""

import itertools

import pytest

from polyshard.errors import PolyshardError
from polyshard.layout import Layout, collapse, expand, refine
from tests.unit.layout_cases import all_layouts

DP_TP = (("dp", 2), ("tp", 2))


# -- construction ---------------------------------------------------------------------


def test_from_spec_accepts_none_name_and_tuple():
    axes = (("dp", 2), ("tp", 2), ("sp", 2))
    lay = Layout.from_spec(axes, [("dp", "tp"), None, "sp"])
    assert lay.dims == (("dp", "tp"), (), ("sp",))
    assert lay.partial == ()
    assert lay.ndim == 3
    assert lay.num_shards(0) == 4 and lay.num_shards(1) == 1 and lay.num_shards(2) == 2
    assert lay.dim_of("tp") == 0 and lay.dim_of("sp") == 2
    assert not lay.is_replicated


def test_replicated_layout():
    lay = Layout.replicated(DP_TP, 3)
    assert lay.dims == ((), (), ())
    assert lay.is_replicated
    assert lay.dim_of("dp") is None
    assert str(lay) == "RR"
    # a pending sum is not replicated even though no dim is split
    assert not Layout(DP_TP, ((), (), ()), ("tp",)).is_replicated


def test_from_placements_shard_replicate_partial():
    from torch.distributed.tensor import Partial, Replicate, Shard

    axes = (("dp", 2), ("tp", 2), ("sp", 2))
    lay = Layout.from_placements(axes, [Shard(1), Partial(), Replicate()], ndim=2)
    assert lay.dims == ((), ("dp",))
    assert lay.partial == ("tp",)
    # two axes sharding one dim: outer mesh axis is the outer split
    lay = Layout.from_placements(axes, [Shard(0), Replicate(), Shard(0)], ndim=2)
    assert lay.dims == (("dp", "sp"), ())
    # negative dims count from the end
    lay = Layout.from_placements(axes, [Shard(-1), Replicate(), Replicate()], ndim=3)
    assert lay.dims == ((), (), ("dp",))


def test_from_placements_errors():
    from torch.distributed.tensor import Replicate, Shard

    with pytest.raises(PolyshardError, match="1 placements for a 2-axis mesh"):
        Layout.from_placements(DP_TP, [Shard(0)], ndim=2)
    with pytest.raises(PolyshardError, match="not Shard, Replicate or Partial"):
        Layout.from_placements(DP_TP, [Shard(0), "S(1)"], ndim=2)
    # two axes may shard the same dim
    assert Layout.from_placements(DP_TP, [Shard(0), Shard(0)], ndim=1).dims == (("dp", "tp"),)
    assert Layout.from_placements(DP_TP, [Replicate(), Replicate()], ndim=1).is_replicated


def test_placements_hand_written():
    from torch.distributed.tensor import Partial, Replicate, Shard

    axes = (("dp", 2), ("tp", 2), ("sp", 2))
    lay = Layout(axes, ((), ("sp",)), ("dp",))
    assert lay.placements() == (Partial(), Replicate(), Shard(1))
    lay = Layout(axes, (("dp", "tp"), ()))
    assert lay.placements() == (Shard(0), Shard(0), Replicate())


def test_placements_round_trip_every_layout():
    from torch.distributed.tensor import Partial, Replicate, Shard

    axes = (("a", 2), ("b", 3), ("c", 2))
    # every axis independently R, P, S(0) or S(1): all 64 placement lists
    choices = [Replicate(), Partial(), Shard(0), Shard(1)]
    seen = set()
    for combo in itertools.product(choices, repeat=3):
        lay = Layout.from_placements(axes, list(combo), ndim=2)
        assert lay.placements() == combo
        again = Layout.from_placements(axes, lay.placements(), ndim=2)
        assert again == lay
        seen.add(lay)
    assert len(seen) == 64  # distinct placements give distinct layouts


# -- printing ---------------------------------------------------------------------------


def test_str_forms():
    assert str(Layout.from_spec(DP_TP, ["dp", None])) == "S(0)R"
    assert str(Layout.from_spec(DP_TP, [None, "dp"])) == "S(1)R"
    assert str(Layout.from_spec(DP_TP, ["tp", "dp"])) == "S(1)S(0)"
    assert str(Layout.from_spec(DP_TP, [("dp", "tp"), None])) == "S(0)S(0)"
    assert str(Layout(DP_TP, ((), ("tp",)), ("dp",))) == "PS(1)"
    assert str(Layout((), ((),))) == "R"  # no axes at all


def test_describe_forms():
    assert Layout.from_spec(DP_TP, ["dp", None]).describe() == "dp=2:S(0) tp=2:R"
    assert Layout(DP_TP, ((), ("tp",)), ("dp",)).describe() == "dp=2:P tp=2:S(1)"
    # a dim index of two digits must not be cut in the middle
    axes = (("x", 4), ("y", 2))
    lay = Layout(axes, ((),) * 10 + (("x",), ("y",)))
    assert str(lay) == "S(10)S(11)"
    assert lay.describe() == "x=4:S(10) y=2:S(11)"


# -- shapes -----------------------------------------------------------------------------


def test_local_and_global_shapes():
    axes = (("dp", 2), ("tp", 4))
    lay = Layout.from_spec(axes, ["dp", "tp"])
    assert lay.local_shape((8, 12)) == (4, 3)
    assert lay.global_shape((4, 3)) == (8, 12)
    both = Layout.from_spec(axes, [("dp", "tp"), None])
    assert both.local_shape((16, 5)) == (2, 5)
    assert both.global_shape((2, 5)) == (16, 5)
    # a pending sum keeps the full shape on each device
    part = Layout(axes, ((), ()), ("tp",))
    assert part.local_shape((16, 5)) == (16, 5)


def test_check_divides_names_dim_and_size():
    axes = (("dp", 2), ("tp", 3))
    lay = Layout.from_spec(axes, [None, ("dp", "tp")])
    lay.check_divides((7, 12), "weight")  # 6 divides 12; dim 0 is not split
    with pytest.raises(PolyshardError) as err:
        lay.check_divides((7, 10), "weight")
    msg = str(err.value)
    assert "weight" in msg
    assert "6 slices" in msg
    assert "dim 1" in msg
    assert "size 10" in msg
    assert "(7, 10)" in msg


def test_check_divides_wrong_rank():
    lay = Layout.from_spec(DP_TP, ["dp", None])
    with pytest.raises(PolyshardError, match=r"bias: layout has 2 dims, tensor shape \(4,\)"):
        lay.check_divides((4,), "bias")


# -- validation -------------------------------------------------------------------------


def test_unknown_axis_rejected():
    with pytest.raises(PolyshardError, match="pp"):
        Layout(DP_TP, (("pp",), ()))
    with pytest.raises(PolyshardError, match="pp"):
        Layout(DP_TP, ((), ()), ("pp",))
    with pytest.raises(PolyshardError):
        Layout.from_spec(DP_TP, ["ep"])


def test_axis_used_twice_rejected():
    with pytest.raises(PolyshardError, match="twice"):
        Layout(DP_TP, (("dp",), ("dp",)))
    with pytest.raises(PolyshardError, match="twice"):
        Layout(DP_TP, (("tp",), ()), ("tp",))  # split and partial on the same axis
    with pytest.raises(PolyshardError, match="twice"):
        Layout(DP_TP, ((), ()), ("dp", "dp"))


def test_out_of_order_axes_rejected():
    with pytest.raises(PolyshardError, match="outermost first"):
        Layout(DP_TP, (("tp", "dp"),))
    with pytest.raises(PolyshardError, match="outermost first"):
        Layout.from_spec(DP_TP, [("tp", "dp"), None])


# -- refine / expand / collapse ---------------------------------------------------------


def test_refine_one_axis_against_two():
    refined, spans_a, spans_b = refine((("tp", 4),), (("rep", 2), ("i", 2)))
    assert refined == (("tp:0", 2), ("tp:1", 2))
    assert spans_a == {"tp": ("tp:0", "tp:1")}
    assert spans_b == {"rep": ("tp:0",), "i": ("tp:1",)}


def test_refine_mixed_cuts():
    # 12 devices as 2 x 6 and as 4 x 3. Inner cuts (counting from the innermost axis):
    # a cuts at 6, b at 3; 3 divides 6 so the common matrix is 2 x 2 x 3 (outer to inner).
    # a's inner axis y (6) becomes y:0 (2) x y:1 (3); b's u (4) spans x and y:0, v (3) is y:1.
    refined, spans_a, spans_b = refine((("x", 2), ("y", 6)), (("u", 4), ("v", 3)))
    assert refined == (("x", 2), ("y:0", 2), ("y:1", 3))
    assert spans_a == {"x": ("x",), "y": ("y:0", "y:1")}
    assert spans_b == {"u": ("x", "y:0"), "v": ("y:1",)}


def test_refine_identical_matrices_keeps_names():
    refined, spans_a, spans_b = refine(DP_TP, (("p", 2), ("q", 2)))
    assert refined == DP_TP
    assert spans_a == {"dp": ("dp",), "tp": ("tp",)}
    assert spans_b == {"p": ("dp",), "q": ("tp",)}


def test_refine_incompatible_matrices():
    with pytest.raises(PolyshardError, match="no common refinement"):
        refine((("a", 2), ("b", 3)), (("c", 3), ("d", 2)))
    with pytest.raises(PolyshardError, match="different device counts"):
        refine((("a", 4),), (("b", 2), ("c", 3)))


def test_expand_hand_example():
    a = (("x", 2), ("y", 6))
    b = (("u", 4), ("v", 3))
    refined, spans_a, spans_b = refine(a, b)
    lay_b = Layout(b, (("u",), ("v",)))
    assert expand(lay_b, refined, spans_b).dims == (("x", "y:0"), ("y:1",))
    lay_a = Layout(a, ((), ("x",)), ("y",))
    big = expand(lay_a, refined, spans_a)
    assert big.dims == ((), ("x",))
    assert big.partial == ("y:0", "y:1")
    assert big.axes == (("x", 2), ("y:0", 2), ("y:1", 3))


@pytest.mark.parametrize(
    "a, b",
    [
        ((("x", 2), ("y", 6)), (("u", 4), ("v", 3))),
        ((("tp", 4),), (("rep", 2), ("i", 2))),
        ((("dp", 2), ("tp", 4)), (("e", 8),)),
    ],
)
def test_expand_then_collapse_is_identity(a, b):
    refined, spans_a, spans_b = refine(a, b)
    for axes, spans in ((a, spans_a), (b, spans_b)):
        layouts = all_layouts(axes, 2)
        assert len(layouts) == 4 ** len(axes)
        for lay in layouts:
            big = expand(lay, refined, spans)
            assert big.axes == refined
            assert collapse(big, axes, spans) == lay


def test_collapse_rejects_part_of_an_axis():
    refined, spans_a, _ = refine((("tp", 4),), (("rep", 2), ("i", 2)))
    with pytest.raises(PolyshardError, match="only part of axis tp"):
        collapse(Layout(refined, (("tp:1",),)), (("tp", 4),), spans_a)
    with pytest.raises(PolyshardError, match="only part of axis tp"):
        collapse(Layout(refined, (("tp:0",), ("tp:1",))), (("tp", 4),), spans_a)
