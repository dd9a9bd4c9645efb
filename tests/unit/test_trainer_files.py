"""What `polyshard train` tells its user about the files it writes."""

from polyshard.runtime.trainer import _open_metrics


def test_replacing_an_earlier_runs_metrics_is_said(tmp_path, capsys):
    path = tmp_path / "runs" / "m.jsonl"
    _open_metrics(str(path)).close()  # the folder is made, nothing said
    assert path.exists() and "replacing" not in capsys.readouterr().out
    _open_metrics(str(path)).close()
    assert f"metrics: replacing {path}, an earlier run's" in capsys.readouterr().out
