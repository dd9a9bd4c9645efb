"""Multi-copy parallel: interleaved batch slices give the unsplit run's losses and parameters."""

import pytest
import torch

from tests.distributed import cases

TOL = 1e-5


def _check(results):
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL, r


@pytest.mark.parametrize("copies", [2, 4])
def test_tp2(pools, copies):
    _check(pools(2).run(cases.train_parity, "tp=2", "gpt-tiny", 5, torch.float64, True, 1, "adamw", 8, copies))


@pytest.mark.parametrize("mesh", ["tp=4", "dp=2,tp=2"])
@pytest.mark.parametrize("copies", [2, 4])
def test_four_ranks(pools, mesh, copies):
    _check(pools(4).run(cases.train_parity, mesh, "gpt-tiny", 5, torch.float64, True, 1, "adamw", 8, copies))


def test_uneven_slices(pools):
    # 6 rows in 4 copies: slices of 2, 2, 1, 1 rows, weighted by rows when the losses merge
    _check(pools(2).run(cases.train_parity, "tp=2", "gpt-tiny", 5, torch.float64, True, 1, "adamw", 6, 4))


def test_fp32_sgd(pools):
    _check(pools(2).run(cases.train_parity, "tp=2", "gpt-tiny", 5, torch.float32, True, 1, "sgd", 8, 2))
