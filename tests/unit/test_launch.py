"""The launcher's agent: torchrun's main in a fork ends with the exit code the interpreter would give."""

import pytest

from polyshard.cli import launch


@pytest.mark.parametrize("raised,code,said", [
    (None, 0, ""),
    (SystemExit(None), 0, ""),
    (SystemExit(3), 3, ""),
    (SystemExit("no rendezvous"), 1, "no rendezvous"),
    (RuntimeError("a rank failed"), 1, "RuntimeError: a rank failed"),
])
def test_the_agent_ends_as_torchrun_would(monkeypatch, capsys, raised, code, said):
    def main(argv):
        assert argv == ["--nproc-per-node=2", "-m", "x"]
        if raised is not None:
            raise raised

    monkeypatch.setattr("torch.distributed.run.main", main)
    assert launch._run_agent(["--nproc-per-node=2", "-m", "x"]) == code
    err = capsys.readouterr().err
    assert said in err and (said or err == "")
