"""The alpha-beta fit recovers known links, and refuses data no link explains."""

import dataclasses

import pytest
import torch

from polyshard import calibrate
from polyshard.calibrate import fit_alpha_beta, measured_product_shares, message_sizes
from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.transitions import wire_bytes

SIZES = message_sizes(16 * 2**20)


@pytest.mark.parametrize("kind,n", [("all_reduce", 2), ("all_reduce", 8), ("all_gather", 4),
                                    ("reduce_scatter", 4), ("all_to_all", 8), ("send_recv", 2)])
def test_fit_recovers_latency_and_bandwidth_within_1_percent(kind, n):
    latency, bandwidth = 35e-6, 3.2e9  # latency per ring step: a collective takes n - 1 of them
    steps = 1 if kind == "send_recv" else n - 1
    sent = [s if kind == "send_recv" else wire_bytes(kind, s, n, "nccl") for s in SIZES]
    noise = [1 + 0.002 * (-1) ** i for i in range(len(SIZES))]  # +-0.2%, alternating
    link = fit_alpha_beta(SIZES, [(steps * latency + b / bandwidth) * e for b, e in zip(sent, noise)], kind, n)
    assert link.latency_s == pytest.approx(latency, rel=0.01)
    assert link.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=0.01)


def test_latency_is_clamped_at_zero():
    link = fit_alpha_beta([4096, 16384, 65536], [1e-6, 7e-6, 31e-6], "send_recv", 2)
    assert link.latency_s == 0.0 and link.bandwidth_bytes_per_s > 0


@pytest.mark.parametrize("sizes,seconds,kind,n,needle", [
    ([4096, 16384], [2e-3, 1e-3], "all_reduce", 2, "do not grow with message size"),
    ([4096, 4096], [1e-3, 2e-3], "all_reduce", 2, "at least two distinct sizes"),
    ([4096, 16384], [1e-3], "all_reduce", 2, "one time per size"),
    ([4096, 16384], [1e-3, 2e-3], "all_reduce", 1, "at least 2 ranks"),
    ([4096, 16384], [0.0, 2e-3], "all_reduce", 2, "positive times"),
    ([4096, 16384], [1e-3, 2e-3], "broadcast", 2, "'broadcast' is unknown"),
])
def test_bad_fit_input_is_named(sizes, seconds, kind, n, needle):
    with pytest.raises(PolyshardError, match=needle):
        fit_alpha_beta(sizes, seconds, kind, n)


def test_message_sizes_are_powers_of_4_from_4_kib():
    assert message_sizes(256 * 2**10) == [4096, 16384, 65536, 262144]
    assert len(SIZES) == 7 and SIZES[-1] == 16 * 2**20
    with pytest.raises(PolyshardError, match="at least 16 KiB"):
        message_sizes(8192)


def test_rates_measured_on_products_count_from_the_depth_measured():
    """A calibration times 8192-deep products: those reach the measured rate, not the preset's share of
    it again, and shallower products keep their share relative to that depth."""
    gpu = Cluster.preset("8xA100-80G")
    efficiency, depths = measured_product_shares(gpu, 8192)
    calibrated = dataclasses.replace(gpu, matmul_efficiency=efficiency, matmul_depth_shares=depths)
    assert calibrated.matmul_share(8192, 8192, 8192) == pytest.approx(1.0)
    assert calibrated.matmul_share(16384, 16384, 16384) == pytest.approx(1.0)
    ratio = gpu.matmul_share(8192, 8192, 1024) / gpu.matmul_share(8192, 8192, 8192)
    assert calibrated.matmul_share(8192, 8192, 1024) == pytest.approx(ratio)
    cpu = Cluster.preset("cpu-gloo:2")  # no depths: every product at the measured rate
    assert measured_product_shares(cpu, 1024) == (1.0, ())



@pytest.mark.parametrize("budget_s,expected", [(1e-12, 16), (1e9, 128)])
def test_products_are_timed_at_the_largest_size_within_the_budget(budget_s, expected, monkeypatch):
    """Too slow for the budget at every size: the smallest probe; no limit: the size asked."""
    monkeypatch.setattr(calibrate, "_MATMUL_BUDGET_S", budget_s)
    assert calibrate.timeable_matmul_size(torch.float32, 128) == expected


def test_a_product_slowed_once_by_a_lost_time_slice_is_still_timed_at_full_size(monkeypatch):
    """A rank sharing its cores may lose a time slice in one timing: the quickest of several sizes the product
    (one timing of a second would say that float32 must be timed on the smallest products)."""
    timed = calibrate._times

    def one_slow(op, repeats, device, *args):
        return [1.0] + timed(op, repeats, device, *args)[1:]

    monkeypatch.setattr(calibrate, "_times", one_slow)
    assert calibrate.timeable_matmul_size(torch.float32, 128) == 128


def test_ranks_sharing_cores_are_noted():
    assert calibrate.shared_cores_note(4, 1, 2) == ("4 ranks of 1 thread share 2 cores: every figure is timed as they "
                                                    "share them, as training on this machine does")
    assert "2 ranks of 2 threads share 2 cores" in calibrate.shared_cores_note(2, 2, 2)
    assert calibrate.shared_cores_note(2, 1, 2) is None


def test_skew_is_the_nodes_least_wait_per_call_its_growth_per_work_and_the_pairs_wait_per_call():
    """A node whose mean rank waits 3 ms a call after 10 ms of compute and 0.05 s more per further second, and
    pairs that wait about 2 ms whatever the compute (the slice they reach their call apart): node call skew
    3 ms, share of what grows beyond it, pairs' call skew their median."""
    work = (0.01, 0.02, 0.04)
    node = [3e-3 + 0.05 * (w - 0.01) for w in work]
    share = 0.05 * (0.01 * 0.02 + 0.03 * 0.04) / (0.01**2 + 0.02**2 + 0.04**2)  # slope through the origin
    assert calibrate.skew_fit(work, node, [2.2e-3, 1.9e-3, 2.4e-3]) == pytest.approx((share, 3e-3, 2.2e-3))
    assert calibrate.skew_fit(work, node, None) == pytest.approx((share, 3e-3, 0.0))  # no group smaller than the node
    above_least = (1e-3 * 0.01 + 0.5e-3 * 0.04) / 2.1e-3  # the waits beyond the least, through the origin
    assert calibrate.skew_fit(work, [3e-3, 2e-3, 2.5e-3], None) == pytest.approx((above_least, 2e-3, 0.0))
    assert calibrate.skew_fit(work, [-1e-4] * 3, [-1e-4, -2e-4, 1e-4]) == (0.0, 0.0, 0.0)  # noise below zero: none


def _noisy_then(clean_after: int, monkeypatch) -> tuple[list[int], list[str]]:
    """Sweeps whose all_reduce times fall with message size until ``clean_after`` sweeps have run; the repeats each
    sweep ran with, and what calibration said."""
    ran, said = [], []

    def sweeps(base, sizes, repeats):
        ran.append(repeats)
        grow = len(ran) > clean_after
        seconds = [1e-4 + s / 1e9 if grow else 1e-3 / (i + 1) for i, s in enumerate(sizes)]
        return {"all_reduce": calibrate.Sweep("all_reduce", 2, seconds, "")}

    monkeypatch.setattr(calibrate, "_sweeps", sweeps)
    try:
        calibrate._fitted_sweeps(Cluster.preset("cpu-gloo:2"), SIZES, 3, said.append)
    except PolyshardError as e:
        said.append(str(e))
    return ran, said


def test_collectives_too_noisy_to_fit_are_timed_again_with_twice_the_repeats(monkeypatch):
    ran, said = _noisy_then(1, monkeypatch)
    assert ran == [3, 6] and len(said) == 1
    assert said[0].startswith("collectives again with 6 repeats (all_reduce times (") and "do not grow" in said[0]


def test_calibration_gives_up_on_collectives_that_never_fit(monkeypatch):
    ran, said = _noisy_then(9, monkeypatch)
    assert ran == [3, 6, 12] and "no bandwidth fits" in said[-1] and len(said) == 3
