"""The runtime on CUDA: parameters, batches and every buffer on the GPU, trained as one device does.

A world of one runs on NCCL, as ``polyshard train`` does on a GPU. Data parallel runs two ranks on one
GPU through gloo, which carries CUDA tensors for all-reduce. One GPU cannot show more: NCCL refuses two
ranks on one device, and gloo sends no CUDA tensor point to point (pipelines) and hung on DTensor's
collectives (operator parallel); those paths run in tests/distributed on CPU. Float64 AdamW, as in test_parity;
transformers models as in test_hf. Plans are made on meta: the GPU must capture the graph they name.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from polyshard import models
from polyshard.graph.capture import capture
from polyshard.models import hf
from tests.distributed import cases, hf_cases

TOL = 1e-5


def _check(results):
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL, r


def _on_gpu(fn, *args, **kwargs):
    """``fn``'s result, and whether every parameter the parallel module made lives on the GPU."""
    import polyshard as ps

    seen = []
    real = ps.parallelize

    def spy(*a, **k):
        pm = real(*a, **k)
        seen.append({p.device.type for p in pm.parameters()})
        return pm

    ps.parallelize = spy
    try:
        out = fn(*args, **kwargs)
    finally:
        ps.parallelize = real
    return out | {"devices": set().union(*seen)}


def test_a_world_of_one_on_nccl():
    _check([_on_gpu(cases.train_parity, "dp=1", "gpt-tiny", 5, torch.float64)])


def test_data_parallel(gpu_pools):
    results = gpu_pools(2).run(_on_gpu, cases.train_parity, "dp=2", "gpt-tiny", 5, torch.float64)
    _check(results)
    assert all(r["devices"] == {"cuda"} for r in results), results


def test_transformers_models_on_nccl():
    """GPT-2 and Llama as transformers writes them, captured by torch.export, trained on the GPU."""
    for family in ("gpt2", "llama"):
        r = _on_gpu(hf_cases.hf_parity, "dp=1", family)
        assert r["loss_err"] < TOL and r["param_err"] < TOL and not r["missing"] and r["devices"] == {"cuda"}, r


def test_transformers_data_parallel(gpu_pools):
    results = gpu_pools(2).run(_on_gpu, hf_cases.hf_parity, "dp=2", "llama")
    assert all(r["loss_err"] < TOL and r["param_err"] < TOL and r["devices"] == {"cuda"} for r in results), results


@pytest.mark.parametrize("family", sorted(hf.TINY))
def test_a_capture_on_meta_is_the_graph_the_gpu_captures(family):
    """Plans are made on meta and name graph nodes; the GPU's attention kernels must not change the graph."""
    graphs = []
    for device in ("meta", "cuda"):
        model = models.build(f"hf:{family}", device=device)
        graphs.append([(n.name, n.op, n.target) for n in capture(model, model.example_inputs(2)).graph.nodes])
    assert graphs[0] == graphs[1]


def _polyshard(*args: str, cwd=None, **env) -> str:
    out = subprocess.run([sys.executable, "-m", "polyshard.cli.main", *args], capture_output=True, text=True,
                         cwd=cwd, env=os.environ | {"PYTHONUNBUFFERED": "1"} | env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _train(steps: int, folder, *args: str, **env) -> tuple[str, list[float]]:
    text = _polyshard("train", "--nproc", "1", "--steps", str(steps), "--log-every", "1", *args, cwd=folder, **env)
    return text, [float(x) for x in re.findall(r"loss (\d+\.\d+)", text)]


def test_the_cli_trains_on_the_gpu_as_on_the_cpu(tmp_path):
    """``polyshard train`` on one GPU (NCCL) prints the losses the same run prints on the CPU."""
    (tmp_path / "gpu").mkdir(), (tmp_path / "cpu").mkdir()
    text, on_gpu = _train(10, tmp_path / "gpu")
    assert "on cuda:0" in text, text[-2000:]
    _, on_cpu = _train(10, tmp_path / "cpu", CUDA_VISIBLE_DEVICES="")
    assert len(on_gpu) == len(on_cpu) == 10
    gap = max(abs(a - b) / b for a, b in zip(on_gpu, on_cpu))
    print(f"largest relative gap between the GPU and CPU losses over 10 steps: {gap:.2e}")
    assert gap < 1e-3, (on_gpu, on_cpu)


def test_a_plan_made_on_meta_trains_a_transformers_model_on_the_gpu(tmp_path):
    """``polyshard plan`` for an H200 (the model on meta) then ``train --plan`` on the GPU; ``train --auto`` too."""
    _polyshard("plan", "--model", "hf:llama", "--cluster", "1x1xH200-141G", "--out", str(tmp_path / "p.json"))
    text, losses = _train(3, tmp_path, "--plan", str(tmp_path / "p.json"))
    assert "on cuda:0" in text and len(losses) == 3, text[-2000:]
    text, losses = _train(3, tmp_path, "--auto", "--model", "hf:gpt2")
    assert "on cuda:0" in text and len(losses) == 3, text[-2000:]
