"""Checkpoints from the command line: a rank killed mid-run restarts the job, which resumes and ends where the
uninterrupted run ends; a stopped rank fails the run by name; bad checkpoints are refused before launch."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polyshard.runtime.checkpoint import committed, read_full, step_dir
from polyshard.runtime.training_state import MODEL

RUN = ["--nproc", "2", "--model", "gpt-tiny", "--mesh", "dp=2", "--batch-size", "64"]


def polyshard(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "polyshard.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def start(tmp: Path, name: str, *flags) -> subprocess.Popen:
    out, err = (tmp / f"{name}.out").open("w"), (tmp / f"{name}.err").open("w")  # files: a full pipe would block
    (tmp / "scratch").mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "polyshard.cli.main", "train", *RUN, *flags,
                             "--metrics", str(tmp / f"{name}.jsonl")], stdout=out, stderr=err, text=True,
                            env={**os.environ, "TMPDIR": str(tmp / "scratch")})


def signal_rank_at(proc: subprocess.Popen, metrics: Path, step: int, rank: int, sig: int) -> int:
    """Send ``sig`` to ``rank``'s process once the metrics reach ``step``; returns the step it reached."""
    while not metrics.exists() or len(metrics.read_text().splitlines()) < step:
        assert proc.poll() is None, "the run ended before the signal"
        time.sleep(0.01)
    for pid in _descendants(proc.pid):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env and b"polyshard.cli.main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, sig)
            return len(metrics.read_text().splitlines())
    raise AssertionError(f"no process of rank {rank}")


def _descendants(pid: int) -> list[int]:
    from polyshard.cli.launch import _descendants

    return _descendants(pid)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """An uninterrupted run of 20 steps, checkpointed every 5: the reference the interrupted runs must equal,
    and the checkpoints the refusal cases damage."""
    root = tmp_path_factory.mktemp("whole")
    out = polyshard("train", *RUN, "--steps", "20", "--save-dir", str(root / "ck"), "--save-every", "5",
                    "--metrics", str(root / "m.jsonl"))
    assert out.returncode == 0, out.stderr[-3000:]
    return root


def _matches_the_whole_run(tmp_path: Path, whole: Path) -> None:
    """The metrics of the whole run, in order, once each, and the final weights equal the uninterrupted run's,
    bit for bit."""
    assert losses(tmp_path / "killed.jsonl") == losses(whole / "m.jsonl")
    a, b = read_full(step_dir(whole / "ck", 20), MODEL), read_full(step_dir(tmp_path / "killed", 20), MODEL)
    assert all(a[k].equal(b[k]) for k in a)


def test_a_rank_killed_while_an_async_save_is_uncommitted_restarts_the_job_from_the_save_before(tmp_path, whole):
    """A killed rank restarts the job, which resumes and ends as the uninterrupted run does. Training goes on
    while a save is written, committed when the next one starts: a kill in between leaves a hidden partial
    directory; the restarted job resumes from the checkpoint before and replaces it."""
    proc = start(tmp_path, "killed", "--steps", "20", "--save-dir", str(tmp_path / "killed"), "--save-every", "5",
                 "--async-save", "--keep", "2", "--max-restarts", "1")
    partial = tmp_path / "killed" / ".step-00000010.partial"  # committed when step 15 saves
    while not partial.exists():
        assert proc.poll() is None, "the run ended before its save of step 10"
        time.sleep(0.001)
    at = signal_rank_at(proc, tmp_path / "killed.jsonl", 10, rank=1, sig=signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, (tmp_path / "killed.err").read_text()[-3000:]
    out = (tmp_path / "killed.out").read_text()
    assert at < 20 and "resumed from" in out and "(step 5)" in out, out[-2000:]
    _matches_the_whole_run(tmp_path, whole)
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == ["step-00000015", "step-00000020"]
    left = [p.name for p in (tmp_path / "scratch").iterdir() if p.name.startswith(("polyshard-", "torchelastic_"))]
    assert not left  # no run folder stays behind, a killed rank's included


def test_a_run_stopped_from_outside_saves_the_step_it_was_in_and_resumes_to_the_whole_runs_end(tmp_path, whole):
    """A scheduler's SIGTERM to the launcher: every rank ends the step it is in, saves it (between the periodic
    saves), and exits; the launcher names that checkpoint, and the run resumed from it ends as the uninterrupted
    run does."""
    proc = start(tmp_path, "killed", "--steps", "20", "--save-dir", str(tmp_path / "killed"), "--save-every", "5")
    metrics = tmp_path / "killed.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 6:
        assert proc.poll() is None, (tmp_path / "killed.err").read_text()[-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, (tmp_path / "killed.err").read_text()[-3000:]
    ran = len(metrics.read_text().splitlines())
    newest = committed(tmp_path / "killed")[-1]
    assert 6 <= ran < 20 and newest == step_dir(tmp_path / "killed", ran)  # nothing trained is lost
    assert f"its newest checkpoint is {newest} (train again with --resume auto" in \
        (tmp_path / "killed.err").read_text()
    # the same run again (its output and metrics in the same files), from where it stopped
    resumed = start(tmp_path, "killed", "--steps", "20", "--save-dir", str(tmp_path / "killed"), "--save-every", "5",
                    "--resume", "auto")
    assert resumed.wait(timeout=300) == 0, (tmp_path / "killed.err").read_text()[-3000:]
    assert f"resumed from {newest} (step {ran})" in (tmp_path / "killed.out").read_text()
    _matches_the_whole_run(tmp_path, whole)


def test_a_command_that_resumes_if_any_starts_fresh_then_continues_to_the_whole_runs_end(tmp_path, whole):
    """`--resume if-any`, which a Kubernetes pod restarted with its job's command runs: the first time, with no
    checkpoint, a fresh start; the second, from the newest checkpoint, ending as the uninterrupted run ends."""
    flags = ("--save-dir", str(tmp_path / "killed"), "--save-every", "5", "--resume", "if-any")
    first = start(tmp_path, "killed", "--steps", "10", *flags)
    assert first.wait(timeout=300) == 0, (tmp_path / "killed.err").read_text()[-3000:]
    assert "resumed from" not in (tmp_path / "killed.out").read_text()
    again = start(tmp_path, "killed", "--steps", "20", *flags)
    assert again.wait(timeout=300) == 0, (tmp_path / "killed.err").read_text()[-3000:]
    assert f"resumed from {step_dir(tmp_path / 'killed', 10)} (step 10)" in (tmp_path / "killed.out").read_text()
    _matches_the_whole_run(tmp_path, whole)


def test_ranks_stopped_without_their_launcher_end_the_job_there_restarting_nothing(tmp_path):
    """A stop that reaches the ranks but not their launcher, as on each machine but the one a scheduler stopped,
    ends the job there too: the ranks save the step they were in, and the launcher, told so, says where to continue
    from instead of restarting them."""
    proc = start(tmp_path, "stopped", "--steps", "1000", "--save-dir", str(tmp_path / "ck"), "--save-every", "1000",
                 "--max-restarts", "1")
    at = signal_rank_at(proc, tmp_path / "stopped.jsonl", 3, rank=1, sig=signal.SIGTERM)
    code = proc.wait(timeout=120)
    err = (tmp_path / "stopped.err").read_text()
    assert code == 128 + signal.SIGTERM, err[-3000:]
    ran = len((tmp_path / "stopped.jsonl").read_text().splitlines())
    newest = committed(tmp_path / "ck")[-1]
    assert at <= ran < 1000 and newest == step_dir(tmp_path / "ck", ran)
    said = f"polyshard: stopped by SIGTERM, and every rank with it after step {ran}; its newest checkpoint is {newest}"
    assert err.count(said) == 1 and "resumed from" not in (tmp_path / "stopped.out").read_text(), err[-3000:]


def test_a_stopped_rank_fails_the_run_within_the_timeout_naming_it(tmp_path):
    # 5 s: with 2, a rank slowed by the rest of a loaded 2-core machine was once declared stopped before step 5
    proc = start(tmp_path, "stopped", "--steps", "100000", "--collective-timeout", "5")
    signal_rank_at(proc, tmp_path / "stopped.jsonl", 5, rank=1, sig=signal.SIGSTOP)
    stopped = time.monotonic()
    code = proc.wait(timeout=120)
    err = (tmp_path / "stopped.err").read_text()
    assert code == 2 and "polyshard: error: rank 1 stopped responding: rank 0 waited 5 s in" in err, err[-3000:]
    assert time.monotonic() - stopped < 30  # timeout, the others' marks, then the launcher ends what is left


def _damaged(whole: Path, tmp: Path, damage) -> Path:
    copy = tmp / "ck"
    shutil.copytree(whole / "ck", copy)
    damage(step_dir(copy, 20))
    return copy


def _edit_manifest(ck: Path, **changes):
    manifest = json.loads((ck / "polyshard.json").read_text())
    (ck / "polyshard.json").write_text(json.dumps({**manifest, **changes}))


def _flip_metadata_byte(ck: Path):
    data = bytearray((ck / ".metadata").read_bytes())
    data[len(data) // 2] ^= 1
    (ck / ".metadata").write_bytes(bytes(data))


DAMAGE = {
    "a manifest that is not JSON": (lambda ck: (ck / "polyshard.json").write_text("{"), "is not valid JSON"),
    "a manifest of another format": (lambda ck: _edit_manifest(ck, format="x"), "is not a polyshard-checkpoint/1"),
    "a changed metadata file": (_flip_metadata_byte, "does not match its manifest's hash"),
    "a truncated data file": (lambda ck: (ck / "__0_0.distcp").write_bytes(b"x"), "the checkpoint is damaged"),
    "a file name outside the checkpoint": (lambda ck: _edit_manifest(ck, files={".metadata": 1, "../m.jsonl": 2}),
                                           "not a plain name inside it"),
    "no manifest (a save that never finished)": (lambda ck: (ck / "polyshard.json").unlink(),
                                                 "not a complete polyshard checkpoint"),
}


def refused(argv: list[str], monkeypatch, capsys) -> str:
    """The one error line ``polyshard train ARGV`` gives, in this process, failing the test if it launches."""
    from polyshard.cli import main as cli

    def launched(*args, **kwargs):
        pytest.fail(f"launched {args}: the input was accepted")

    monkeypatch.setattr(cli, "launch", launched)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    code = cli.main(["train", "--nproc", "2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_refused_before_launch(whole, tmp_path, case, monkeypatch, capsys):
    damage, message = DAMAGE[case]
    ck = _damaged(whole, tmp_path, damage)
    assert message in refused(["--model", "gpt-tiny", "--steps", "40", "--resume", str(step_dir(ck, 20))],
                              monkeypatch, capsys)


REFUSED = {
    "no such directory": (["--resume", "/nonexistent/ck"], "no such checkpoint directory"),
    "an empty save directory": (["--resume", "auto", "--save-dir", "{tmp}/empty"], "holds no complete checkpoint"),
    "another model": (["--model", "gpt-small", "--resume", "{ck}"],
                      "is of model 'gpt-tiny'; this run trains 'gpt-small'"),
    "another optimizer": (["--optimizer", "sgd", "--resume", "{ck}"], "holds adamw state; this run's optimizer is sgd"),
    "a step at or past --steps": (["--steps", "20", "--resume", "{ck}"], "is at step 20, and --steps 20 ends there"),
    "a fresh run over saved checkpoints": (["--save-dir", "{saved}"], "holds another run's checkpoints"),
    "--save-every without --save-dir": (["--save-every", "5"], "need --save-dir"),
    "--resume auto without --save-dir": (["--resume", "auto"], "give --save-dir"),
    "--resume if-any without --save-dir": (["--resume", "if-any"], "--resume if-any continues from the newest"),
    "--resume if-any onto another model's": (["--model", "gpt-small", "--resume", "if-any", "--save-dir", "{saved}"],
                                             "is of model 'gpt-tiny'; this run trains 'gpt-small'"),
    "--max-restarts below 0": (["--max-restarts", "-1"], "--max-restarts must be 0 or more"),
    "--collective-timeout below 0": (["--collective-timeout", "-1"], "--collective-timeout must be a number"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_checkpoint_that_does_not_fit_the_run_is_refused_before_launch(whole, tmp_path, case, monkeypatch, capsys):
    flags, message = REFUSED[case]
    flags = [f.format(tmp=tmp_path, ck=step_dir(whole / "ck", 20), saved=whole / "ck") for f in flags]
    model = [] if "--model" in flags else ["--model", "gpt-tiny"]
    steps = [] if "--steps" in flags else ["--steps", "40"]
    assert message in refused([*model, *steps, *flags], monkeypatch, capsys)


def _logits_of_checkpoint(name: str, ck: Path, ids):
    """The logits polyshard's model computes with a checkpoint's weights."""
    from polyshard import models

    model = models.build(name)
    model.load_state_dict({k[len(MODEL):]: v for k, v in read_full(ck, MODEL).items()}, strict=False)
    if name.startswith("hf:"):
        return model.model.eval()(ids).logits
    got = {}
    model.lm_head.register_forward_hook(lambda module, args, out: got.setdefault("logits", out))
    model.eval()(ids, ids)
    return got["logits"]


@pytest.mark.parametrize("model", ["gpt-tiny", "hf:llama"])
def test_export_writes_a_model_transformers_loads_with_the_same_logits(whole, tmp_path, model):
    """A checkpoint of polyshard's GPT, or of transformers' Llama named by its family and trained with its
    projections split over 2 ranks on rows of half its longest length (which must learn), exported whole for
    transformers."""
    import torch
    import transformers

    ck = whole / "ck"
    if model != "gpt-tiny":
        ck = tmp_path / "ck"
        out = polyshard("train", "--nproc", "2", "--mesh", "tp=2", "--model", model, "--seq-len", "16", "--steps",
                        "12", "--batch-size", "4", "--save-dir", str(ck), "--metrics", str(tmp_path / "m.jsonl"))
        assert out.returncode == 0, out.stderr[-3000:]
        assert re.search(r"model\.layers\.0\.self_attn\.q_proj\.weight +tp=2:S\(0\)", out.stdout)  # column-parallel
        trained = losses(tmp_path / "m.jsonl")
        assert len(trained) == 12 and sum(trained[-3:]) < sum(trained[:3])  # it learns
        first = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
        assert abs(first["tokens_per_s"] * first["step_s"] / (4 * 16) - 1) < 0.1  # rows of 16 tokens, not 32
    out = polyshard("export", str(ck), "--to", "hf", "--out", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr[-3000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    newest = committed(ck)[-1]
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, _logits_of_checkpoint(model, newest, ids))
