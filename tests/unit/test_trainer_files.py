"""What `polyshard train` tells its user about the files it writes."""

from polyshard.train.trainer import _open_metrics


def test_replacing_an_earlier_runs_metrics_is_said(tmp_path, capsys):
    path = tmp_path / "runs" / "m.jsonl"
    _open_metrics(str(path), []).close()  # the folder is made, nothing said
    assert path.exists() and "replacing" not in capsys.readouterr().out
    _open_metrics(str(path), []).close()
    assert f"metrics: replacing {path}, an earlier run's" in capsys.readouterr().out


def test_a_resumed_run_rewrites_the_metrics_up_to_its_checkpoint_and_appends(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')  # step 3 ran after the checkpoint of step 2
    with _open_metrics(str(path), [{"step": 1}, {"step": 2}]) as f:
        f.write('{"step": 3, "again": true}\n')
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3, "again": true}\n'
    assert "replacing" not in capsys.readouterr().out
