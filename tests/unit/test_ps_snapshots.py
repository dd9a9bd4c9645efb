"""Server snapshots on disk: the previous kept, and the update a resumed run starts each server from."""

import pytest
import torch

from polyshard.errors import PolyshardError
from polyshard.runtime.ps.snapshots import (make_newest, read_snapshot, resume_points, servers_in, snapshot_path,
                                            write_snapshot)


def _wrote(folder, index, *versions):
    for version in versions:
        write_snapshot(str(folder), index, {"version": version})


def test_a_snapshot_keeps_the_one_before_and_reading_falls_back_to_it(tmp_path):
    _wrote(tmp_path, 0, 3, 6)
    assert read_snapshot(str(tmp_path), 0)["version"] == 6
    assert torch.load(snapshot_path(str(tmp_path), 0, previous=True))["version"] == 3
    snapshot_path(str(tmp_path), 0).unlink()  # a kill between the two renames
    assert read_snapshot(str(tmp_path), 0)["version"] == 3
    assert read_snapshot(str(tmp_path), 1) is None


def test_a_sync_run_resumes_every_server_from_the_newest_update_all_kept(tmp_path):
    """Stopped after server 0 wrote update 9 and before server 1 did: both go back to 6, server 0 from its
    previous snapshot, which becomes its newest."""
    _wrote(tmp_path, 0, 3, 6, 9)
    _wrote(tmp_path, 1, 3, 6)
    assert servers_in(str(tmp_path)) == 2
    points = resume_points(str(tmp_path), 2, sync=True)
    assert [v for v, _ in points] == [6, 6]
    for index, (_, path) in enumerate(points):
        make_newest(str(tmp_path), index, path)
    assert [read_snapshot(str(tmp_path), i)["version"] for i in range(2)] == [6, 6]
    assert [v for v, _ in resume_points(str(tmp_path), 2, sync=False)] == [6, 6]


def test_async_resumes_each_server_from_its_newest_and_sync_needs_an_update_in_common(tmp_path):
    _wrote(tmp_path, 0, 9, 12)
    _wrote(tmp_path, 1, 3, 6)
    assert [v for v, _ in resume_points(str(tmp_path), 2, sync=False)] == [12, 6]
    with pytest.raises(PolyshardError, match=r"share no update \(server 0: \[9, 12\], server 1: \[3, 6\]\)"):
        resume_points(str(tmp_path), 2, sync=True)
    with pytest.raises(PolyshardError, match="server 2 left no snapshot"):
        resume_points(str(tmp_path), 3, sync=True)
