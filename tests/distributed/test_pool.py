"""The shared rank pool: a case that fails on one rank, leaving its peers in a collective, costs that case
only; the cases after it get a fresh group."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import pool


def fail_on_rank_one_while_rank_zero_reduces():
    if dist.get_rank() == 1:
        raise ValueError("rank one fails here")
    dist.all_reduce(torch.ones(1))  # never completes: rank one is not coming


def sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def test_a_rank_failing_mid_collective_fails_its_case_and_not_the_next(pools, monkeypatch):
    monkeypatch.setattr(pool, "STRAGGLER_GRACE_S", 2)
    with pytest.raises(AssertionError, match=r"(?s)ranks \[0\] did not finish.*rank one fails here"):
        pools(2).run(fail_on_rank_one_while_rank_zero_reduces)
    assert pools(2).run(sum_of_ranks) == [1.0, 1.0]
