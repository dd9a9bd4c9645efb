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


def test_a_gloo_group_left_open_is_released_before_the_interpreter_ends():
    """A script that never destroys its process group: init's exit handler does, while the interpreter lives (the
    check registered before init runs after it)."""
    import subprocess
    import sys

    script = ("import atexit\nimport torch.distributed as dist\n"
              "atexit.register(lambda: print('group open at exit:', dist.is_initialized()))\n"
              "import polyshard as ps\nps.init()\nprint('group open:', dist.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["group open: True", "group open at exit: False"]
