"""Recompute on tensor-parallel ranks: the single-device run's losses and parameters, and with
comm="keep" no collective is issued again in backward."""

import pytest
import torch

from tests.distributed.recompute_cases import recompute_parity

TOL = 1e-5


def _check(results, regions: int = 2):
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL, r
        assert len(r["regions"]) == regions, r["regions"]  # one per block, or attention core; shared by copies


@pytest.mark.parametrize("mode", ["full", "selective", "pointwise", "alternate", "half"])
def test_tp2(pools, mode):
    _check(pools(2).run(recompute_parity, "tp=2", mode), 1 if mode == "half" else 2)


def test_full_with_interleaved_copies(pools):
    _check(pools(2).run(recompute_parity, "tp=2", "full", "keep", torch.float64, "adamw", 2))


def test_fp32_sgd(pools):
    _check(pools(2).run(recompute_parity, "tp=2", "full", "keep", torch.float32, "sgd"))


@pytest.mark.parametrize("mode", ["full", "pointwise"])
def test_kept_collectives_are_not_issued_again(pools, mode):
    plain, keep, again = (pools(2).run(recompute_parity, "tp=2", mode, comm)
                          for mode, comm in (("none", "keep"), (mode, "keep"), (mode, "recompute")))
    _check(keep)
    _check(again)
    for p, k, a in zip(plain, keep, again):
        assert k["backward_collectives"] == p["backward_collectives"], (k, p)
        assert all(nk < na for nk, na in zip(k["backward_collectives"], a["backward_collectives"])), (k, a)
        assert torch.allclose(torch.tensor(k["losses"]), torch.tensor(a["losses"]), rtol=1e-12, atol=0)
