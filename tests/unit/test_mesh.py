"""parse_mesh, check_mesh and Mesh's rank arithmetic (no process group needed)."""

import pytest

from polyshard.errors import PolyshardError
from polyshard.mesh import Mesh, check_mesh, parse_mesh


def test_parse_mesh_good():
    assert parse_mesh("dp=2,tp=2") == {"dp": 2, "tp": 2}
    assert list(parse_mesh("tp=4,dp=2")) == ["tp", "dp"]  # order is kept: outer first
    assert parse_mesh(" dp = 2 , tp=8 ") == {"dp": 2, "tp": 8}
    assert parse_mesh("world=1") == {"world": 1}
    assert parse_mesh("dp=2,") == {"dp": 2}  # a trailing comma is harmless
    assert parse_mesh("dp=16") == {"dp": 16}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("dp=0", "dp=0: the size must be at least 1"),
        ("dp", "'dp' is not NAME=SIZE"),
        ("dp=2,tp", "'tp' is not NAME=SIZE"),
        ("dp=-1", "dp=-1: the size must be at least 1"),
        ("dp=two", "'dp=two': the size must be a whole number"),
        ("dp=2.5", "'dp=2.5': the size must be a whole number"),
        ("dp=2,,tp=2", "empty entry between commas"),
        ("=2", "'=2' is not NAME=SIZE"),
        ("2x=2", "'2x=2' is not NAME=SIZE"),
        ("dp=2,dp=2", "'dp' appears twice"),
        ("dp=2,tp=2,dp=4", "'dp' appears twice"),
        ("", "names no axes"),
        (" , ,", "names no axes"),
    ],
)
def test_parse_mesh_bad(text, fragment):
    with pytest.raises(PolyshardError) as err:
        parse_mesh(text)
    assert fragment in str(err.value)


def test_check_mesh():
    check_mesh({"dp": 2, "tp": 2}, 4)
    check_mesh({"world": 1}, 1)
    with pytest.raises(PolyshardError) as err:
        check_mesh({"dp": 2, "tp": 2}, 8)
    msg = str(err.value)
    assert "dp=2 x tp=2" in msg
    assert "holds 4 devices" in msg
    assert "world has 8 processes" in msg
    assert "multiply to 8" in msg
    with pytest.raises(PolyshardError, match="world has 3 processes"):
        check_mesh({"dp": 2, "tp": 3}, 3)


def test_coords_and_data_index_2x2():
    axes = (("dp", 2), ("tp", 2))
    # later axes are inner: consecutive ranks differ in tp first
    expected = {
        0: ({"dp": 0, "tp": 0}, 0),
        1: ({"dp": 0, "tp": 1}, 0),
        2: ({"dp": 1, "tp": 0}, 1),
        3: ({"dp": 1, "tp": 1}, 1),
    }
    for r, (coords, data_index) in expected.items():
        m = Mesh(axes=axes, data_axes=("dp",), device_type="cpu", rank=r)
        assert m.coords() == coords
        assert m.data_index == data_index
        assert m.op_axes == (("tp", 2),)
        assert m.world_size == 4
        assert m.num_data_shards == 2


def test_coords_and_data_index_two_data_axes():
    # 2 x 3 x 2 with data axes dp (outer) and ep (inner): data index is dp * 2 + ep.
    axes = (("dp", 2), ("tp", 3), ("ep", 2))
    expected_coords = [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1),
        (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1), (1, 2, 0), (1, 2, 1),
    ]
    expected_index = [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]
    for r in range(12):
        m = Mesh(axes=axes, data_axes=("dp", "ep"), device_type="cpu", rank=r)
        c = m.coords()
        assert (c["dp"], c["tp"], c["ep"]) == expected_coords[r]
        assert m.data_index == expected_index[r]
    assert m.op_axes == (("tp", 3),)
    assert m.num_data_shards == 4
    assert m.world_size == 12


def test_op_axes_and_no_data_axes():
    m = Mesh(axes=(("dp", 2), ("tp", 2)), data_axes=(), device_type="cpu", rank=3)
    assert m.op_axes == (("dp", 2), ("tp", 2))
    assert m.num_data_shards == 1
    assert m.data_index == 0
    m = Mesh(axes=(("dp", 4),), data_axes=("dp",), device_type="cpu", rank=3)
    assert m.op_axes == ()
    assert m.data_index == 3
    assert m.coords() == {"dp": 3}


def test_op_axes_keep_mesh_order_around_data_axis():
    m = Mesh(axes=(("pp", 2), ("dp", 2), ("tp", 2)), data_axes=("dp",), device_type="cpu", rank=5)
    assert m.op_axes == (("pp", 2), ("tp", 2))
    # rank 5 = 1*4 + 0*2 + 1
    assert m.coords() == {"pp": 1, "dp": 0, "tp": 1}
    assert m.data_index == 0


def test_mesh_str_names_roles():
    m = Mesh(axes=(("dp", 2), ("tp", 2)), data_axes=("dp",), device_type="cpu", rank=0)
    assert str(m) == "dp=2(data) x tp=2(op)"


def test_device_mesh_without_op_axes_is_an_error():
    m = Mesh(axes=(("dp", 4),), data_axes=("dp",), device_type="cpu", rank=0)
    with pytest.raises(PolyshardError, match="no operator axes"):
        m.device_mesh()
