"""The checkpoint directory's rules, without a process group: what counts as saved, and what is read."""

import pickle

import pytest

from polyshard.errors import PolyshardError
from polyshard.runtime import checkpoint


def test_only_committed_checkpoints_count_and_auto_takes_the_newest(tmp_path):
    for name in ("step-00000002", "step-00000010", ".step-00000015.partial", "notes", "step-12"):
        (tmp_path / name).mkdir()
    assert [p.name for p in checkpoint.committed(tmp_path)] == ["step-00000002", "step-00000010"]
    assert checkpoint.resolve("auto", str(tmp_path)).name == "step-00000010"  # the save killed at 15 is ignored
    assert checkpoint.resolve("auto", str(tmp_path / "none")) is None


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "/etc/passwd", "a\\b", "a\0b", 3, None])
def test_file_names_read_from_disk_stay_inside(tmp_path, name):
    with pytest.raises(PolyshardError, match="not a plain name inside it"):
        checkpoint.confined(tmp_path, name)


def test_metadata_is_unpickled_admitting_only_dcps_records(tmp_path):
    class Anything:
        def __reduce__(self):
            return (print, ("ran",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Anything()))
    with pytest.raises(PolyshardError, match="builtins.print is not part of DCP metadata"):
        checkpoint.read_metadata(tmp_path)
