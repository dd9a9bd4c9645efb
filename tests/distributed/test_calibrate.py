"""``polyshard calibrate`` end to end: two ranks time compute and links, and the planner reads the file."""

import subprocess
import sys
import time

import pytest
import torch

from polyshard import calibrate
from polyshard.cli.main import main
from polyshard.cluster import Cluster


def test_calibrate_writes_a_cluster_the_planner_reads(tmp_path):
    out = tmp_path / "cluster.yaml"
    # messages up to the default 16 MiB: on a loaded machine, times up to 4 MiB can be all latency and noise
    run = subprocess.run([sys.executable, "-m", "polyshard.cli.main", "calibrate", "--nproc", "2", "--out", str(out),
                          "--repeats", "3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    # what it times as it goes, said once (by rank 0) on stderr; the figures on stdout at the end (and a sweep too
    # noisy to fit is timed again, said so)
    said = [line.split(": ", 1)[1] for line in run.stderr.splitlines() if line.startswith("calibrating (")]
    assert len(said) >= 7 and said[0] == "matmul rate per dtype" and said[6].startswith("collectives on")
    assert all(again.startswith("collectives again with") for again in said[7:])
    for needle in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "bus bandwidth",
                   "inter_node is a copy of intra_node", "fixed cost per op", "host <-> disk"):
        assert needle in run.stdout
    cluster = Cluster.from_yaml(out)
    assert (cluster.num_nodes, cluster.devices_per_node, cluster.device_type) == (1, 2, "cpu")
    assert cluster.flops_per_s["float32"] > 0
    assert cluster.intra_node.bandwidth_bytes_per_s > 0 and cluster.intra_node.latency_s >= 0
    assert cluster.inter_node == cluster.intra_node
    # how far apart ranks reach a collective after the same work: a share of that work, timed
    assert "arrival skew" in run.stdout and 0 <= cluster.arrival_skew < 1
    assert "call skew" in run.stdout and cluster.call_skew_s == 0  # two ranks: no group smaller than the node
    # transcendental pointwise ops timed in each dtype whose products were
    assert set(cluster.pointwise_rates) == set(cluster.flops_per_s) and "pointwise ops" in run.stdout
    assert all(set(rates) == {"gelu", "silu", "tanh", "sigmoid", "exp", "erf", "cross_entropy",
                              "vocab_parallel_cross_entropy"} and min(rates.values()) > 1e6
               for rates in cluster.pointwise_rates.values())
    # cross-entropy's fixed cost of a call apart from its rate, per implementation, in each dtype
    assert set(cluster.loss_overheads_s) == set(cluster.flops_per_s) and all(
        set(costs) == {"cross_entropy", "vocab_parallel_cross_entropy"} and 0 <= min(costs.values()) < 0.1
        for costs in cluster.loss_overheads_s.values())
    # eager dispatch costs microseconds per op; the runtime's split product, whose DTensors dispatch each of its
    # steps in Python, more than a whole plain op on top of that; AdamW's step microseconds per tensor
    assert 1e-7 < cluster.op_overhead_s < cluster.split_op_overhead_s < 1e-1
    assert 1e-7 < cluster.optimizer_overhead_s < 1e-2 and "optimizer, per tensor" in run.stdout
    # checkpointing costs a CPU microseconds per op it reruns, and a policy watching each op more
    assert 1e-7 < cluster.recompute_op_overhead_s < 1e-2 and "recomputed, extra" in run.stdout
    assert 1e-7 < cluster.watched_op_overhead_s < 1e-2 and "watched, extra" in run.stdout
    # a CPU's half-precision kernels are timed on their own step: each dtype whose products were timed
    assert set(cluster.op_overheads_s) == set(cluster.flops_per_s) - {"float32"}
    assert all(1e-7 < s < 1e-2 for s in cluster.op_overheads_s.values()) and "plain, bfloat16" in run.stdout
    assert cluster.host_bandwidth_bytes_per_s > 1e7 and cluster.disk_bandwidth_bytes_per_s > 1e6
    assert cluster.memory_bandwidth_bytes_per_s > 1e8 and "memory (read + write)" in run.stdout
    # offload steps the optimizer on the host, which on a CPU is the device: its own figures, written as the host's
    assert (cluster.host_memory_bandwidth_bytes_per_s, cluster.host_optimizer_overhead_s) == \
        (cluster.memory_bandwidth_bytes_per_s, cluster.optimizer_overhead_s) and "host step, per tensor" in run.stdout
    # causal attention timed on a grid of sequence lengths and head dims per dtype, each a share of that dtype's
    # matmul rate
    assert "attention (causal, forward + backward)" in run.stdout
    for points in (cluster.attention_shares["float32"], cluster.attention_shares["bfloat16"]):
        assert [(seq, dim) for seq, dim, _ in points] == [(s, d) for d in (8, 32, 64) for s in (16, 64, 256, 1024)]
        assert all(0 < share <= 1 for *_, share in points)
    # products timed by contraction depth in each dtype the CPU runs natively (float32 at least): the shallowest
    # below the rate of the large product the peak comes from, none above it
    assert "matmul by contraction depth" in run.stdout
    depths = cluster.matmul_shares["float32"]
    assert [d for d, _ in depths] == [32, 64, 128, 256, 512, 1024] and all(0 < sh <= 1 for _, sh in depths)
    planned = subprocess.run([sys.executable, "-m", "polyshard.cli.main", "plan", "--model", "gpt-tiny",
                              "--cluster", str(out)], capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stderr[-3000:]


def test_one_process_measures_the_device_and_keeps_the_presets_links(tmp_path):
    """A world of one (one GPU) has no collective to time: the device is measured, the links are its preset's."""
    out = tmp_path / "one.yaml"
    run = subprocess.run([sys.executable, "-m", "polyshard.cli.main", "calibrate", "--nproc", "1", "--out", str(out),
                          "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no collective to time" in run.stdout and "bus bandwidth" not in run.stdout
    cluster, preset = Cluster.from_yaml(out), Cluster.preset("cpu-gloo:1")
    assert (cluster.num_nodes, cluster.devices_per_node) == (1, 1)
    assert (cluster.intra_node, cluster.inter_node) == (preset.intra_node, preset.inter_node)
    assert cluster.flops_per_s["float32"] > 0 and 1e-7 < cluster.op_overhead_s < 1e-2


@pytest.mark.parametrize("flags,needle", [
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--max-bytes", "8KiB"], "use at least 16 KiB"),
    (["--max-bytes", "lots"], "size 'lots' is not understood"),
    (["--out", "no/such/folder/cluster.yaml"], "folder that does not exist"),
])
def test_bad_calibrate_flags_exit_nonzero_with_a_message(flags, needle, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["calibrate", *flags]) == 2
    assert needle in capsys.readouterr().err


def _timed_spans(repeats: int) -> list[float]:
    """Seconds each of ``repeats`` timings of a 5 ms op spanned on this rank, as calibration times compute."""
    calls = []

    def op():
        calls.append(1)
        time.sleep(0.005)

    means = calibrate._compute_times(op, repeats, torch.device("cpu"))
    per_timing = (len(calls) - 5) / repeats  # five untimed: two warm-ups and the three calls that sized the timings
    return [mean * per_timing for mean in means]


def test_a_timing_of_compute_on_a_cpu_outlasts_a_time_slice(pools):
    """Ranks sharing cores take turns within a scheduler's time slice, each timing a core of its own; so each
    timing runs as many calls as fill _CPU_TIMING_S (half of it at least where load slowed the calls that sized
    it; one call would span a tenth)."""
    for spans in pools(2).run(_timed_spans, 3):
        assert len(spans) == 3 and min(spans) >= calibrate._CPU_TIMING_S / 2, spans


def _skews() -> tuple[float, float, float]:
    return calibrate.measure_arrival_skew(torch.device("cpu"), 3, calibrate._pairs(Cluster.from_env()))


def test_four_ranks_time_the_skew_of_their_pairs_and_agree_on_it(pools):
    """A node of four holds pairs smaller than itself: every rank times its pair's calls and all write the
    same figures (the mean rank's, all-reduced)."""
    skews = pools(4).run(_skews)
    assert len(set(skews)) == 1, skews
    share, node_call_s, pair_call_s = skews[0]
    assert 0 <= share < 1 and 0 <= node_call_s < 0.1 and 0 <= pair_call_s < 0.1


def _sweeps_on_two_nodes() -> tuple[dict[str, int], float]:
    """(group size per sweep, this rank's rail's sum of ranks) on 4 ranks taken as 2 nodes of 2."""
    base = Cluster.preset("2x2xcpu")
    sweeps = calibrate._sweeps(base, [2**14, 2**16], 1)
    rank = torch.tensor([float(torch.distributed.get_rank())])
    torch.distributed.all_reduce(rank, group=calibrate._rail(base))
    return {label: sweep.group_size for label, sweep in sweeps.items() if sweep.seconds}, rank.item()


def test_on_several_nodes_the_inter_node_link_is_timed_one_rank_a_node_every_rail_at_once(pools):
    """The inter-node link is one NIC per device (the planner multiplies it by the ranks a group has in each node):
    its all_reduce is timed on groups of one rank a node, the same local rank on each."""
    results = pools(4).run(_sweeps_on_two_nodes)
    sizes = {label: 2 for label in calibrate.KINDS} | {calibrate.RAILS: 2}
    assert [r[0] for r in results] == [sizes] * 4
    assert [r[1] for r in results] == [0 + 2, 1 + 3, 0 + 2, 1 + 3]
