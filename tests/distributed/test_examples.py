"""The scripts in examples/ run as their docstrings say, and the ones that train lower their loss."""

import re
import sys
from pathlib import Path

import pytest

from tests.distributed.test_cli import polyshard

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["train_gpt", "train_hf_llama", "spatial_unet", "matmul_strategies"])
def test_an_example_runs_on_four_processes(name, tmp_path):
    if name == "train_hf_llama":
        pytest.importorskip("transformers")
    out = polyshard("run", "-n", "4", str(EXAMPLES / f"{name}.py"), cwd=tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    if name == "matmul_strategies":
        assert out.stdout.count("matches: True") >= 2 and "matches: False" not in out.stdout, out.stdout
        return
    losses = [float(x) for x in re.findall(r"loss:? (\d+\.\d+)", out.stdout)]
    assert len(losses) >= 3 and losses[-1] < losses[0], out.stdout[-2000:]


def test_the_parameter_server_example_trains_its_table(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, str(EXAMPLES / "parameter_server.py")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+); table \(50000, 16\)", out.stdout).groups())
    assert last < first, out.stdout[-2000:]
