"""The launcher's agent: torchrun's main in a fork ends with the exit code the interpreter would give."""

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from polyshard.cli import launch


def _failed(exitcode: int) -> ChildFailedError:
    """torchrun's report of rank 1 ending with ``exitcode`` (negative: a signal)."""
    return ChildFailedError("x", {1: ProcessFailure(local_rank=1, pid=4242, exitcode=exitcode, error_file="")})


@pytest.mark.parametrize("raised,code,said", [
    (None, 0, ""),
    (SystemExit(None), 0, ""),
    (SystemExit(3), 3, ""),
    (SystemExit("no rendezvous"), 1, "no rendezvous"),
    (RuntimeError("a rank failed"), 1, "RuntimeError: a rank failed"),
    # a rank's own output says why it failed: the report is one line, and the job ends with the rank's code
    (_failed(3), 3, "polyshard: error: rank 1 (pid 4242) exited with code 3, and the job stopped\n"),
    (_failed(-9), 1, "polyshard: error: rank 1 (pid 4242) was ended by SIGKILL, and the job stopped\n"),
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
    if isinstance(raised, ChildFailedError):
        assert err == said  # no traceback, no banner


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`polyshard models | head -1`: the reader closes the pipe before the command has written; no traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "from polyshard.cli.main import run; run()", "models"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and err == b"", err.decode()


def test_a_stopped_training_run_names_where_to_continue_from(tmp_path):
    from polyshard.cli.main import _saved_so_far

    assert _saved_so_far("") == ""
    assert _saved_so_far(str(tmp_path)) == f"; it had saved no checkpoint in {tmp_path}"
    for step in (100, 200):
        (tmp_path / f"step-{step:08d}").mkdir()
    assert f"newest checkpoint is {tmp_path / 'step-00000200'} (train again with --resume auto" in \
        _saved_so_far(str(tmp_path))


def test_a_second_signal_while_stopping_is_not_a_second_stop():
    """The first SIGINT or SIGTERM raises; until the block ends, more are ignored (the processes are ending)."""
    import os
    import signal

    from polyshard.runtime.signals import Interrupt, interrupts_raised

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupt) as stop:
        with interrupts_raised():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except Interrupt:
                assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
                raise
    assert stop.value.signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) == before


def test_a_training_rank_notes_a_stop_and_goes_on_until_its_ranks_agree():
    """Inside the block SIGTERM and SIGINT are noted, the first kept, and the process goes on (its ranks stop after
    the step they are in); after it, the handlers are what they were."""
    import os
    import signal
    import threading

    from polyshard.runtime.signals import stops_noted

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with stops_noted() as noted:
        assert noted.signum == 0
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert noted.signum == signal.SIGTERM
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    seen = []  # off the main thread, which signals never reach, nothing is installed

    def elsewhere():
        with stops_noted() as noted:
            seen.append((noted.signum, signal.getsignal(signal.SIGTERM) == before[0]))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [(0, True)]


def test_a_stopped_agent_gives_its_ranks_the_launchers_grace(monkeypatch):
    """torchrun's agent, sent SIGTERM, kills its ranks after its own shutdown timeout (30 s unless told): it is
    told the launcher's grace, so a checkpointing run's ranks get all of it to save the step they were in (a save
    held 40 s was killed at 30 s before)."""
    import os

    started = []

    class Agent:  # an agent that ends at once, having recorded its flags
        def __init__(self, argv, env):
            started.append(argv)
            read, write = os.pipe()
            os.close(write)
            self.pid, self.stderr = 0, os.fdopen(read, "rb", buffering=0)

        def wait(self):
            self.stderr.close()
            return 0

    monkeypatch.setattr(launch, "_Agent", Agent)
    assert launch.launch(1, ["-c", "pass"], stop_grace_s=launch.SAVE_STOP_GRACE_S) == 0
    assert f"--shutdown-timeout={launch.SAVE_STOP_GRACE_S:.0f}" in started[0]
