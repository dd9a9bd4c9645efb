"""polyshard.init in a world of one process: meshes and clusters that cannot fit fail first."""

import pytest

import polyshard as ps
from polyshard.errors import PolyshardError


def test_default_mesh_is_all_ranks():
    mesh = ps.init()
    assert mesh.axes == (("world", 1),) and mesh.cluster.num_devices == 1


def test_mesh_that_does_not_cover_the_world():
    with pytest.raises(PolyshardError, match="holds 4 devices but the world has 1"):
        ps.init({"dp": 2, "tp": 2})


def test_cluster_that_does_not_match_the_world():
    with pytest.raises(PolyshardError, match="cluster of 8 devices .* does not match the world of 1"):
        ps.init(cluster="8xA100-80G")


def test_unknown_preset():
    with pytest.raises(PolyshardError, match="A999"):
        ps.init(cluster="8xA999")
