"""GPU tests: run with ``python -m pytest tests/gpu`` on a machine with a CUDA device; elsewhere they refuse
to start rather than pass without running."""

import pytest
import torch

from tests.distributed.pool import pools_by_world

if not torch.cuda.is_available():
    raise pytest.UsageError("tests/gpu needs a CUDA device: run `python -m pytest tests/gpu` on a GPU machine")


@pytest.fixture(scope="session")
def gpu_pools():
    """Rank pools by world size whose ranks all share GPU 0 (gloo carries their CUDA tensors)."""
    with pools_by_world(one_device=True) as get:
        yield get
