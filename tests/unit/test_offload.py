"""Host and disk offload checked against plain torch runs: the same losses and parameters bit for bit,
files that survive a kill at any point, less resident memory, and a ledger that matches the shapes."""

import copy
import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from polyshard import models
from polyshard.errors import PolyshardError
from polyshard.models import MLPClassifier
from polyshard.models.gpt import GPT
from polyshard.runtime.offload import OffloadedOptimizer, offload_embedding, offload_parameters

ROOT = Path(__file__).resolve().parents[2]
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
              "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g)


def train(model, opt, steps: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        loss = model(*batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def make_optimizer(model, kind: str, mode: str, path: Path):
    cls, kwargs = OPTIMIZERS[kind]
    if mode == "plain":
        return cls(model.parameters(), **kwargs)
    return OffloadedOptimizer(model.parameters(), cls, mode=mode, path=path if mode == "disk" else None, **kwargs)


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def untied_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(models.CONFIGS["gpt-tiny"], num_layers=3, tied=False))


# The wrapped optimizer runs the same kernels on the same values as a plain run: equality is exact.
@pytest.mark.parametrize("mode", ["host", "disk"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_offloaded_optimizer_steps_as_plain_torch(kind, mode, tmp_path):
    ref = models.build("gpt-tiny")
    model = copy.deepcopy(ref)
    ref_losses = train(ref, make_optimizer(ref, kind, "plain", tmp_path), 5)
    assert train(model, make_optimizer(model, kind, mode, tmp_path / "state"), 5) == ref_losses
    assert_same_parameters(ref, model)


@pytest.mark.parametrize("mode", ["plain", "host", "disk"])
def test_parameter_offload_and_host_embedding_train_as_plain_torch(mode, tmp_path):
    ref = untied_gpt()
    model = copy.deepcopy(ref)
    ref_losses = train(ref, make_optimizer(ref, "adamw", "plain", tmp_path), 5)
    offload_parameters(model, model.blocks, prefetch=1)
    assert offload_embedding(model) == ["wte", "wpe"]
    assert train(model, make_optimizer(model, "adamw", mode, tmp_path / "state"), 5) == ref_losses
    assert_same_parameters(ref, model)


def test_blocks_run_on_copies_fetched_ahead_and_released():
    model = untied_gpt()
    fc_weights = [block.mlp.fc.weight for block in model.blocks]
    offload = offload_parameters(model, model.blocks, prefetch=1)
    seen, in_backward = [], []
    for b, block in enumerate(model.blocks):
        block.mlp.fc.register_forward_hook(
            lambda m, args, out, b=b: seen.append((b, m.weight is fc_weights[b], weakref.ref(m.weight), offload.resident)))
        block.mlp.register_full_backward_hook(lambda m, gi, go, b=b: in_backward.append((b, offload.resident)))
    loss = model(*batch(0))
    assert [(b, original, resident) for b, original, _, resident in seen] == [
        (0, False, {0, 1}), (1, False, {1, 2}), (2, False, {2})]
    assert all(copy_ref() is None for *_, copy_ref, _ in seen)  # autograd keeps no copy past its block
    assert offload.resident == set() and model.blocks[0].mlp.fc.weight is fc_weights[0]
    loss.backward()
    assert in_backward == [(2, {1, 2}), (1, {0, 1}), (0, {0})]
    assert offload.resident == set()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in fc_weights)


def test_tied_weights_are_refused_or_left_on_the_device():
    model = models.build("gpt-tiny")  # the LM head shares the token embedding
    with pytest.warns(UserWarning, match="wte's table is shared"):
        assert offload_embedding(model) == ["wpe"]
    with pytest.raises(PolyshardError, match="share their table"):
        offload_embedding(model)  # wpe is already on the host: nothing left to move
    block = model.blocks[0]
    model.blocks[1].ln1.weight = block.ln1.weight
    with pytest.raises(PolyshardError, match="also used by LayerNorm outside it"):
        offload_parameters(model, [block])


def test_mistakes_are_clear_errors(tmp_path):
    params = list(models.build("gpt-tiny").parameters())
    with pytest.raises(PolyshardError, match="mode must be 'host' or 'disk'"):
        OffloadedOptimizer(params, mode="gpu")
    with pytest.raises(PolyshardError, match="needs path="):
        OffloadedOptimizer(params, mode="disk")
    with pytest.raises(PolyshardError, match="LBFGS"):
        OffloadedOptimizer(params, torch.optim.LBFGS)
    with pytest.raises(PolyshardError, match="no committed step to resume"):
        OffloadedOptimizer(params, mode="disk", path=tmp_path, resume=True)
    opt = OffloadedOptimizer(params, mode="disk", path=tmp_path)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    with pytest.raises(PolyshardError, match="holds step 1 of an earlier run; pass resume=True"):
        OffloadedOptimizer(params, mode="disk", path=tmp_path)


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_state_dicts_move_between_offloaded_and_plain_optimizers(mode, tmp_path):
    ref = models.build("gpt-tiny")
    ref_losses = train(ref, make_optimizer(ref, "adamw", "plain", tmp_path), 6)
    plain_model = models.build("gpt-tiny")
    plain = make_optimizer(plain_model, "adamw", "plain", tmp_path)
    train(plain_model, plain, 2)
    model = copy.deepcopy(plain_model)
    offloaded = make_optimizer(model, "adamw", mode, tmp_path / "state")
    offloaded.load_state_dict(plain.state_dict())
    losses = train(model, offloaded, 2, first=2)
    back = make_optimizer(model, "adamw", "plain", tmp_path)
    back.load_state_dict(offloaded.state_dict())
    assert losses + train(model, back, 2, first=4) == ref_losses[2:]
    assert_same_parameters(ref, model)


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_ledger_matches_the_parameter_shapes(mode, tmp_path):
    model = untied_gpt()
    blocks = offload_parameters(model, model.blocks)
    opt = make_optimizer(model, "adamw", mode, tmp_path / "state")
    train(model, opt, 1)
    sizes = {id(p): math.prod(p.shape) * 4 for p in model.parameters()}  # fp32: 4 bytes an element
    on_host = {id(p) for p in blocks.parameters()}
    kept = sum(n for i, n in sizes.items() if i in on_host)
    total = sum(sizes.values())
    ledger = opt.ledger(on_host=blocks.parameters())
    expected = {("device", "params"): total - kept, ("device", "grads"): total - kept,
                ("host", "params"): kept, ("host", "grads"): kept,
                (mode, "master"): total, (mode, "state"): 2 * total + 4 * len(sizes)}  # exp_avg, exp_avg_sq, step
    assert ledger.bytes == expected
    assert ledger.get("device") == 2 * (total - kept)


def reference_run(steps: int) -> tuple[GPT, dict]:
    """Plain AdamW for ``steps`` steps on one thread, as the crash child runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = models.build("gpt-tiny")
        opt = make_optimizer(model, "adamw", "plain", Path())
        train(model, opt, steps)
        return model, opt.state_dict()
    finally:
        torch.set_num_threads(threads)


def crash_child(path: str, pause_at: str) -> None:
    """Trains on disk state until killed; with ``pause_at`` ("replace|replaced NAME N"), it says so and
    waits at the Nth rename of NAME, before or after it, for the parent's SIGKILL."""
    torch.set_num_threads(1)
    if pause_at:
        when, name, nth = pause_at.split()
        count, real_replace = [0], os.replace

        def replace(src, dst):
            count[0] += Path(dst).name == name
            pause = count[0] == int(nth)
            if pause and when == "replace":
                print("paused", flush=True)
                time.sleep(60)
            real_replace(src, dst)
            if pause and when == "replaced":
                print("paused", flush=True)
                time.sleep(60)

        os.replace = replace
    model = models.build("gpt-tiny")
    opt = make_optimizer(model, "adamw", "disk", Path(path))
    for step in range(40):
        train(model, opt, 1, first=step)
        print("done", opt.num_steps, flush=True)


def run_and_kill(path: Path, pause_at: str = "", delay_s: float = 0.0) -> int:
    """Starts crash_child, SIGKILLs it when it pauses (or ``delay_s`` after its first step); its last step done."""
    code = f"from tests.unit.test_offload import crash_child; crash_child({str(path)!r}, {pause_at!r})"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for line in child.stdout:
            if line.startswith("done") and delay_s:
                time.sleep(delay_s)
                break
            if line.startswith("paused"):
                break
    finally:
        child.send_signal(signal.SIGKILL)
        printed = child.stdout.read().split()  # what it printed up to the kill
        child.wait()
    assert child.returncode == -signal.SIGKILL, "the child ended before it was killed"
    return max((int(n) for word, n in zip(printed, printed[1:]) if word == "done"), default=1 if delay_s else 0)


def assert_resumes_exactly(path: Path) -> int:
    """Loads the state left in ``path`` and compares it with a plain run of as many steps; returns that count."""
    model = models.build("gpt-tiny", seed=1)  # other values: resuming must set the parameters
    opt = OffloadedOptimizer(model.parameters(), torch.optim.AdamW, mode="disk", path=path, resume=True,
                             **OPTIMIZERS["adamw"][1])
    ref_model, ref_state = reference_run(opt.num_steps)
    assert_same_parameters(ref_model, model)
    state = opt.state_dict()["state"]
    assert state.keys() == ref_state["state"].keys()
    for i, ref_entry in ref_state["state"].items():
        for key, value in ref_entry.items():
            assert torch.equal(state[i][key], value), (i, key)
    named = [record["file"] for record in json.loads((path / "manifest.json").read_text())["files"].values()]
    assert sorted(f.name for f in path.iterdir()) == sorted(["manifest.json", *named])  # no leftovers
    return opt.num_steps


# gpt-tiny has 36 parameter tensors, so each step writes param-0 .. param-35, then the manifest.
@pytest.mark.parametrize("pause_at, committed", [
    ("replace param-0.v3.pt 1", 2),  # the first file of step 3 written, not yet renamed
    ("replaced param-20.v3.pt 1", 2),  # step 3 half renamed
    ("replace manifest.json 3", 2),  # all of step 3 written, its manifest not yet renamed
    ("replaced manifest.json 3", 3),  # step 3 committed, step 2's files not yet removed
])
def test_a_kill_during_a_write_resumes_from_the_last_committed_step(pause_at, committed, tmp_path):
    run_and_kill(tmp_path, pause_at)
    assert assert_resumes_exactly(tmp_path) == committed


def test_a_kill_at_a_random_time_resumes_from_a_committed_step(tmp_path):
    delay_s = random.uniform(0.2, 1.5)
    done = run_and_kill(tmp_path, delay_s=delay_s)
    assert assert_resumes_exactly(tmp_path) in (done, done + 1), f"killed {delay_s:.2f} s after step 1"


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete"])
def test_damaged_state_is_an_error_not_a_wrong_resume(damage, tmp_path):
    model = models.build("gpt-tiny")
    train(model, make_optimizer(model, "adamw", "disk", tmp_path), 2)
    file = tmp_path / "param-3.v2.pt"
    data = bytearray(file.read_bytes())
    if damage == "flip a byte":
        data[len(data) // 2] ^= 1
        file.write_bytes(bytes(data))
    elif damage == "truncate":
        file.write_bytes(bytes(data[:-10]))
    else:
        file.unlink()
    with pytest.raises(PolyshardError, match="param-3.v2.pt"):
        OffloadedOptimizer(models.build("gpt-tiny").parameters(), mode="disk", path=tmp_path, resume=True)


def rss_child(mode: str, path: str) -> None:
    """Prints the resident set after AdamW steps on a ~4.2M-parameter MLP, and the fastest step's time."""
    torch.set_num_threads(1)
    model = MLPClassifier(in_features=2048, hidden=2048, num_classes=16)
    x, y = torch.randn(8, 2048), torch.randint(0, 16, (8,))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if mode == "plain" else
           OffloadedOptimizer(model.parameters(), torch.optim.AdamW, mode=mode, lr=1e-3,
                              **({"path": path} if mode == "disk" else {})))
    step_s = []
    for _ in range(3):
        model(x, y).backward()
        start = time.perf_counter()
        opt.step()
        step_s.append(time.perf_counter() - start)
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    print(json.dumps({"rss_bytes": pages * os.sysconf("SC_PAGE_SIZE"), "step_s": min(step_s)}))


def measure(mode: str, path: Path) -> dict:
    code = f"from tests.unit.test_offload import rss_child; rss_child({mode!r}, {str(path)!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
def test_disk_mode_lowers_resident_memory(tmp_path):
    state_bytes = 2 * 4 * sum(math.prod(p.shape) for p in MLPClassifier(2048, 2048, 16).parameters())
    plain, disk = measure("plain", tmp_path), measure("disk", tmp_path)
    assert plain["rss_bytes"] - disk["rss_bytes"] >= state_bytes / 2, (plain, disk, state_bytes)


def test_a_manifest_naming_a_file_outside_the_store_is_refused_and_nothing_is_deleted(tmp_path):
    from polyshard.runtime.offload.disk import MANIFEST, DiskStore

    store = DiskStore(tmp_path / "state")
    store.commit(1, [(0, {"master": torch.ones(3), "state": {}})])
    outside = tmp_path / "x.pt"
    outside.write_bytes(b"not the store's")
    manifest = json.loads((tmp_path / "state" / MANIFEST).read_text())
    manifest["files"]["0"]["file"] = "../x.pt"
    (tmp_path / "state" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PolyshardError, match="not a plain name inside it"):
        DiskStore(tmp_path / "state", resume=True)
    assert outside.read_bytes() == b"not the store's"
