"""The command line, end to end: bad flags fail fast and clearly; train and run launch ranks."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from polyshard.plan import Plan


def polyshard(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "polyshard.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_models_lists_every_named_config():
    out = polyshard("models")
    assert out.returncode == 0
    for name in ("gpt-tiny", "pangu-alpha-2.6b", "pangu-alpha-13b", "pangu-alpha-200b", "gpt3-175b"):
        assert name in out.stdout
    assert "174.6B" in out.stdout  # GPT-3 175B's parameter count


def test_a_bad_flag_exits_with_code_2_and_one_line():
    out = polyshard("train", "--nproc", "2", "--mesh", "foo=2")  # the whole battery: tests/unit/test_bad_input.py
    assert out.returncode == 2 and out.stderr.count("error:") == 1 and "'foo' has no role" in out.stderr


def test_an_error_the_ranks_find_is_said_once_with_code_2(tmp_path):
    out = polyshard("train", "--nproc", "2", "--model", "gpt-tiny", "--steps", "3", "--lr", "1e30", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count("polyshard: error: loss became nan at step 2; lower --lr") == 1
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr
    assert len((tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()) == 1  # the steps that ran are kept


@pytest.mark.parametrize("signum,to_group", [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGTERM to the launcher", "Ctrl-C to the terminal's group"])
def test_a_stopped_job_ends_every_process_and_says_so(tmp_path, signum, to_group):
    """A scheduler's SIGTERM (to the launcher alone) or Ctrl-C (to the foreground group): one line, the shell's
    exit code for the signal, and no rank left running."""
    script = tmp_path / "wait.py"
    script.write_text("import os, pathlib, time\n"
                      "pathlib.Path(os.environ['RANK'] + '.pid').write_text(str(os.getpid()))\n"
                      "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "polyshard.cli.main", "run", "-n", "2", str(script)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    ranks = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(ranks) == 2, proc.communicate()[1][-2000:]
    os.killpg(proc.pid, signum) if to_group else proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err[-2000:]
    assert f"polyshard: stopped by {signal.Signals(signum).name}, and every process of the job with it" in err
    assert "Traceback" not in err, err[-2000:]
    assert not [pid for pid in ranks if running(pid)]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_train_runs_on_two_ranks_with_pins_and_writes_metrics(tmp_path):
    pins = tmp_path / "pins.yaml"
    pins.write_text("blocks.*.mlp.fc: {in_strategy: [[1, 1, 1], [2, 1]]}\n")
    metrics = tmp_path / "m.jsonl"
    out = polyshard("train", "--nproc", "2", "--mesh", "tp=2", "--model", "gpt-tiny", "--steps", "3",
                    "--strategies", str(pins), "--metrics", str(metrics), "--copies", "2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh: tp=2(op)" in out.stdout and "blocks.0.mlp.fc.weight" in out.stdout
    assert "pinned from" in out.stdout and "2 interleaved copies" in out.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["tokens_per_s"] > 0 for r in records)


def test_train_pins_a_transformers_models_own_tp_plan(tmp_path):
    """`--tp-plan`: Qwen3's projections split as its plan names them, its per-head norms whole on every rank."""
    out = polyshard("train", "--nproc", "2", "--mesh", "tp=2", "--model", "hf:qwen3", "--steps", "2", "--tp-plan",
                    "--metrics", str(tmp_path / "m.jsonl"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for name, layout in (("q_proj", "S(0)"), ("o_proj", "S(1)"), ("q_norm", "R")):
        assert re.search(rf"model\.model\.layers\.0\.self_attn\.{name}\.weight +tp=2:{re.escape(layout)}\n",
                         out.stdout), (name, out.stdout[-3000:])
    assert len(_losses(tmp_path / "m.jsonl")) == 2


def _losses(metrics):
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


TINY = ("train", "--model", "gpt-tiny", "--steps", "4")
PLAIN = (*TINY, "--nproc", "2", "--mesh", "dp=2")


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory):
    """The losses of a plain data-parallel run on 2 ranks, the reference of the runs that change how it trains."""
    folder = tmp_path_factory.mktemp("plain")
    out = polyshard(*PLAIN, "--metrics", str(folder / "m.jsonl"), cwd=folder)
    assert out.returncode == 0, out.stderr[-3000:]
    return _losses(folder / "m.jsonl")


def test_recompute_and_disk_offload_train_as_the_plain_run_does(tmp_path, plain_losses):
    """The trainer end to end on 2 ranks: the same losses with activations recomputed and the optimizer
    state streamed from disk, whose files the run leaves in the folder it was given."""
    out = polyshard(*PLAIN, "--metrics", str(tmp_path / "m.jsonl"), "--recompute", "full", "--offload", "disk",
                    "--offload-dir", str(tmp_path / "state"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _losses(tmp_path / "m.jsonl") == pytest.approx(plain_losses, rel=1e-5)
    assert "recompute full" in out.stdout and "disk   state" in out.stdout
    assert (tmp_path / "state" / "rank1").is_dir()


def test_sequence_parallel_trains_as_the_plain_run_does(tmp_path, plain_losses):
    out = polyshard(*TINY, "--nproc", "2", "--mesh", "tp=2", "--sequence-parallel",
                    "--metrics", str(tmp_path / "m.jsonl"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sequence parallel:" in out.stdout
    assert _losses(tmp_path / "m.jsonl") == pytest.approx(plain_losses, rel=1e-5)


def test_pipelined_training_draws_its_timeline_and_trains_as_the_plain_run(tmp_path, plain_losses):
    out = polyshard(*TINY, "--nproc", "4", "--mesh", "dp=2,pp=2", "--schedule", "gpipe", "--micro-batches",
                    "2", "--timeline", str(tmp_path / "t.png"), "--metrics", str(tmp_path / "m.jsonl"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _losses(tmp_path / "m.jsonl") == pytest.approx(plain_losses, rel=1e-5)
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_memory_limit_makes_the_planner_fit_the_run(tmp_path):
    out = polyshard("train", "--nproc", "2", "--model", "gpt-tiny", "--seq-len", "8", "--steps", "2",
                    "--memory-limit", "900KiB", "--metrics", str(tmp_path / "m.jsonl"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memory limit 900 KiB" in out.stdout and "memory per device" in out.stdout
    used = float(out.stdout.split("memory per device")[1].split(" = ")[1].split(" KiB")[0])
    assert used <= 900
    # the plan it made is written beside the metrics (test_plan_explain_and_train_from_the_plan trains from one)
    assert f"plan: {tmp_path / 'plan.json'} (train it again with --plan {tmp_path / 'plan.json'})" in out.stdout
    written = Plan.from_json((tmp_path / "plan.json").read_text())
    assert math.prod(s for _, s in written.mesh) == 2 and written.model == "gpt-tiny"
    assert (written.global_batch, written.seq_len) == (8, 8)


def test_two_machines_on_localhost_train_as_one_process_does(tmp_path):
    """The Master and Worker commands of `polyshard k8s ... train`, with what the Training Operator puts in the
    pods' environment, run as 2 machines here on a token file (each data-parallel rank reading its rows);
    node 1 starts first and waits at node 0's address."""
    import socket

    from tests.unit.test_k8s import expand, manifests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16).tofile(tokens)
    flags = ["--model", "gpt-tiny", "--mesh", "dp=2,tp=2", "--steps", "3", "--data", str(tokens)]
    (job,) = manifests(tmp_path, "--nodes", "2", "--procs-per-node", "2", "train", *flags)
    nodes = []
    for rank, replica in ((1, "Worker"), (0, "Master")):
        command = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]["command"]
        argv = expand(command, {"RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        (tmp_path / f"node{rank}").mkdir()
        nodes.append(subprocess.Popen([sys.executable, "-m", "polyshard.cli.main", *argv[1:]],
                                      cwd=tmp_path / f"node{rank}",
                                      env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [n.communicate(timeout=600) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), [o[1][-2000:] for o in outs]
    # with restarts allowed the machines meet elastically, and global rank 0 is on whichever node came first
    first = [rank for rank, (out, _) in zip((1, 0), outs) if "(4 processes on 2 machines" in out]
    assert len(first) == 1, outs
    one = polyshard("train", "--nproc", "1", *flags[:2], *flags[4:], "--metrics", str(tmp_path / "one.jsonl"),
                    cwd=tmp_path)  # the same run on one process
    assert one.returncode == 0, one.stderr[-2000:]
    metrics = tmp_path / f"node{first[0]}/runs/metrics.jsonl"
    two = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    single = [json.loads(line)["loss"] for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert len(two) == 3 and two == pytest.approx(single, rel=1e-5)
    assert not (tmp_path / f"node{1 - first[0]}/runs/metrics.jsonl").exists()  # only rank 0 writes metrics


def test_run_launches_a_user_script(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(
        "import torch, torch.distributed as dist, polyshard as ps\n"
        "mesh = ps.init()\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "print(f'rank {dist.get_rank()} of {mesh.world_size}: {int(t.item())}')\n"
        "dist.destroy_process_group()\n"
    )
    out = polyshard("run", "-n", "2", str(script))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 0 of 2: 3" in out.stdout and "rank 1 of 2: 3" in out.stdout


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """`polyshard plan` of gpt-tiny on 2 gloo ranks, written once for the tests that read it: (path, stdout)."""
    plan = tmp_path_factory.mktemp("plan") / "plan.json"
    out = polyshard("plan", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2", "--batch-size", "4", "--out", str(plan))
    assert out.returncode == 0, out.stderr[-2000:]
    return plan, out.stdout


def test_plan_explain_and_train_from_the_plan(tmp_path, tiny_plan):
    plan, printed = tiny_plan
    assert "runner-up" in printed and plan.is_file()
    shown = polyshard("explain", str(plan))
    assert shown.returncode == 0 and "memory per device" in shown.stdout
    trained = polyshard("train", "--nproc", "2", "--plan", str(plan), "--steps", "2", "--batch-size", "4",
                        "--metrics", str(tmp_path / "m.jsonl"), cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "mesh: dp=" in trained.stdout


def test_explain_draws_a_pipelined_plans_timeline(tmp_path, tiny_plan):
    plan = tmp_path / "plan.json"
    data = json.loads(tiny_plan[0].read_text())
    data.update(mesh=[["dp", 1], ["pp", 2]], micro_batches=4, stage_boundaries=[])
    plan.write_text(json.dumps(data))
    shown = polyshard("explain", str(plan), "--timeline", str(tmp_path / "p.png"))
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "predicted bubble" in shown.stdout and (tmp_path / "p.png").stat().st_size > 1000
    data.update(mesh=[["dp", 2]])
    plan.write_text(json.dumps(data))
    flat = polyshard("explain", str(plan), "--timeline", str(tmp_path / "q.png"))
    assert flat.returncode == 2 and "no pp axis" in flat.stderr


def test_plan_that_cannot_fit_says_by_how_much():
    out = polyshard("plan", "--model", "gpt3-175b", "--cluster", "8xA100-80G")
    assert out.returncode == 2 and "does not fit" in out.stderr
    assert "over the 76 GiB limit (80 GiB less a 4 GiB reserve)" in out.stderr
