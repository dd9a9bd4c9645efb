import dataclasses
import os

import pytest
import yaml

from polyshard.cluster import Cluster, Link, format_bytes, parse_bytes
from polyshard.errors import PolyshardError


def test_multi_node_preset():
    c = Cluster.preset("128x8xA100-80G")
    assert (c.num_nodes, c.devices_per_node, c.num_devices) == (128, 8, 1024)
    assert (c.device_type, c.device_name, c.backend) == ("cuda", "A100-80G", "nccl")
    assert c.memory_bytes == 80 * 2**30
    assert c.flops_per_s["bfloat16"] == 312e12
    # NVLink 3 at 300 GB/s per direction and HDR at 25 GB/s, each at the share NCCL's bus bandwidth reaches
    assert c.intra_node == Link(0.78 * 300e9, 2e-6)
    assert c.inter_node.bandwidth_bytes_per_s == 0.92 * 25e9
    h100 = Cluster.preset("2x8xH100-80G")
    assert h100.inter_node.bandwidth_bytes_per_s == 0.92 * 50e9  # NDR 400 Gb/s per GPU
    assert h100.memory_bandwidth_bytes_per_s == 0.87 * 3.35e12 and h100.matmul_efficiency == 0.78


def test_single_node_preset_with_suffix():
    assert Cluster.preset("8xH100-80G-nvlink") == Cluster.preset("1x8xh100-80g")
    c = Cluster.preset("4xH200-141G-ib")
    assert (c.num_nodes, c.num_devices, c.device_name) == (1, 4, "H200-141G")


def test_cpu_gloo(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert Cluster.preset("cpu-gloo").num_devices == 1
    monkeypatch.setenv("WORLD_SIZE", "3")
    c = Cluster.preset("cpu-gloo")
    assert (c.num_nodes, c.devices_per_node, c.backend) == (1, 3, "gloo")
    assert Cluster.preset("cpu-gloo:4").num_devices == 4
    assert c.memory_bytes > 0


def test_ranks_on_one_machine_share_its_memory(monkeypatch):
    """A CPU rank's memory is its share of the machine's: four ranks planned at the whole memory each would
    together ask for four times what there is."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert Cluster.preset("cpu-gloo:1").memory_bytes == machine
    for cluster in (Cluster.preset("cpu-gloo:4"), Cluster.of_machines(2, 4)):
        assert machine - 4 < 4 * cluster.memory_bytes <= machine


@pytest.mark.parametrize("spec", ["8xTPU-v4", "axbxA100-80G", "A100-80G", "0x8xA100-80G", "cpu-gloo:x", ""])
def test_bad_preset_names_the_text(spec):
    with pytest.raises(PolyshardError) as e:
        Cluster.preset(spec)
    assert repr(spec) in str(e.value)


def test_unknown_type_lists_known_ones():
    with pytest.raises(PolyshardError, match="A100-80G.*H100-80G"):
        Cluster.preset("8xTPU-v4")


def test_clusters_hash():
    assert len({Cluster.preset("8xA100-80G"), Cluster.preset("8xA100-80G")}) == 1


def test_yaml_round_trip(tmp_path):
    c = Cluster.preset("16x8xH100-80G")
    path = tmp_path / "cluster.yaml"
    c.to_yaml(path)
    assert Cluster.from_yaml(path) == c
    assert Cluster.load(str(path)) == c
    timed = dataclasses.replace(c, op_overheads_s={"bfloat16": 2e-5})  # a dtype's own fixed cost per op
    timed.to_yaml(path)
    assert Cluster.from_yaml(path) == timed and timed.op_overhead_for("bfloat16") == 2e-5
    assert timed.op_overhead_for("float16") == c.op_overhead_s
    rated = dataclasses.replace(c, pointwise_rates={"bfloat16": {"gelu": 1.2e9, "silu": 1.5e9}})
    rated.to_yaml(path)
    assert Cluster.from_yaml(path) == rated and rated.pointwise_rate("gelu", "bfloat16") == 1.2e9
    assert rated.pointwise_rate("gelu", "float32") is None and rated.pointwise_rate("tanh", "bfloat16") is None
    with pytest.raises(PolyshardError, match="pointwise_rates.bfloat16.gelu must be positive"):
        dataclasses.replace(c, pointwise_rates={"bfloat16": {"gelu": 0.0}})
    skewed = dataclasses.replace(c, arrival_skew=0.2, node_call_skew_s=3e-3, call_skew_s=2e-3)  # arriving apart
    skewed.to_yaml(path)
    assert Cluster.from_yaml(path) == skewed
    path.write_text(path.read_text().replace("arrival_skew: 0.2", "arrival_skew: -0.1"))
    with pytest.raises(PolyshardError, match="arrival_skew must be zero or more"):
        Cluster.from_yaml(path)
    without = dataclasses.replace(c, all_to_all=False)  # a network without all-to-all says so in its file
    without.to_yaml(path)
    assert Cluster.from_yaml(path) == without
    path.write_text(path.read_text().replace("all_to_all: false", "all_to_all: maybe"))
    with pytest.raises(PolyshardError, match="all_to_all must be true or false"):
        Cluster.from_yaml(path)


def test_yaml_missing_and_unknown_keys(tmp_path):
    path = tmp_path / "cluster.yml"
    Cluster.preset("8xA100-40G").to_yaml(path)
    path.write_text(path.read_text().replace("num_nodes:", "nodes:"))
    with pytest.raises(PolyshardError, match="num_nodes.*nodes"):
        Cluster.load(str(path))


def test_yaml_missing_file(tmp_path):
    with pytest.raises(PolyshardError, match="nope.yaml"):
        Cluster.load(str(tmp_path / "nope.yaml"))


def test_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    c = Cluster.from_env()
    assert (c.num_nodes, c.devices_per_node, c.device_type) == (4, 4, "cpu")


def test_from_env_indivisible(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(PolyshardError, match="WORLD_SIZE=6"):
        Cluster.from_env()


@pytest.mark.parametrize(
    "text, n",
    [("70GiB", 70 * 2**30), ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("80GB", 80 * 10**9),
     ("1e9", 10**9), ("1.5 gib", 3 * 2**29), ("100", 100), ("4kb", 4000)],
)
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "1.2.3GB", "-5GB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(PolyshardError, match=repr(text).replace(".", r"\.")):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(3 * 2**29) == "1.5 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(80 * 2**30) == "80 GiB"


def test_yaml_written_before_overheads_takes_its_device_types(tmp_path):
    path = tmp_path / "old.yaml"
    c = Cluster.preset("cpu-gloo:2")
    data = yaml.safe_load(yaml.safe_dump(dataclasses.asdict(c)))
    for key in ("op_overhead_s", "split_op_overhead_s", "optimizer_overhead_s", "host_bandwidth_bytes_per_s",
                "disk_bandwidth_bytes_per_s", "host_memory_bandwidth_bytes_per_s", "host_optimizer_overhead_s",
                "memory_bandwidth_bytes_per_s", "matmul_efficiency", "attention_efficiency", "arrival_skew",
                "node_call_skew_s", "call_skew_s", "pointwise_rates", "loss_overheads_s"):
        del data[key]
    path.write_text(yaml.safe_dump(data))
    assert Cluster.from_yaml(path) == c


def test_overlap_slowdown_round_trips_and_old_gpu_files_take_the_presets(tmp_path):
    path = tmp_path / "gpu.yaml"
    gpu = Cluster.preset("2x8xH100-80G")
    assert gpu.overlap_slowdown > 0 and Cluster.preset("cpu-gloo:2").overlap_slowdown == 0
    measured = dataclasses.replace(gpu, overlap_slowdown=0.3)
    measured.to_yaml(path)
    assert Cluster.from_yaml(path) == measured
    data = yaml.safe_load(path.read_text())
    del data["overlap_slowdown"]
    path.write_text(yaml.safe_dump(data))
    assert Cluster.from_yaml(path).overlap_slowdown == gpu.overlap_slowdown
    with pytest.raises(PolyshardError, match="overlap_slowdown must be zero or more"):
        dataclasses.replace(gpu, overlap_slowdown=-0.1)


def test_attention_share_interpolates_on_log_length_then_log_head_dim_and_holds_the_ends():
    grid = ((16.0, 8.0, 0.02), (256.0, 8.0, 0.10), (16.0, 32.0, 0.08), (256.0, 32.0, 0.40))
    c = dataclasses.replace(Cluster.preset("cpu-gloo:2"), attention_efficiency=0.5, attention_shares={"bfloat16": grid})
    assert c.attention_share("bfloat16", 64, 8) == pytest.approx(0.06)  # halfway in log length
    assert c.attention_share("bfloat16", 64, 16) == pytest.approx((0.06 + 0.24) / 2)  # and halfway in log head dim
    assert c.attention_share("bfloat16", 4, 4) == 0.02 and c.attention_share("bfloat16", 4096, 128) == 0.40
    # equal FLOPs, different shapes: the head dim counts apart from the length
    assert c.attention_share("bfloat16", 32, 32) > c.attention_share("bfloat16", 64, 8)
    assert c.attention_share("float32", 64, 8) == 0.5  # unmeasured dtype: the single efficiency
    assert c.shares_grow_with_size
    assert not dataclasses.replace(c, attention_shares={"bfloat16": grid[:3] + ((256.0, 32.0, 0.05),)}
                                   ).shares_grow_with_size  # longer heads of 32 priced slower than short ones
    with pytest.raises(PolyshardError, match="ascending by head dim"):
        dataclasses.replace(c, attention_shares={"bfloat16": grid[::-1]})
    with pytest.raises(PolyshardError, match="calibrate again"):  # pairs keyed by FLOPs alone
        dataclasses.replace(c, attention_shares={"bfloat16": ((1e4, 0.1), (1e6, 0.2))})


def test_a_product_runs_below_the_large_rate_as_its_contraction_depth_shrinks():
    gpu = Cluster.preset("8xA100-80G")
    deep = gpu.matmul_share(16384, 16384, 16384)
    assert deep == pytest.approx(gpu.matmul_efficiency)
    # a row-parallel split of 6144 over 8 contracts 768 deep in forward; its backward contracts the full widths
    row_split = gpu.matmul_share(2048, 6144, 768)
    assert 0.8 * deep < row_split < 0.95 * deep
    assert gpu.matmul_share(2048, 768, 6144) == pytest.approx(row_split)  # each pass's depth counts once
    assert gpu.matmul_share(8, 8, 8) == pytest.approx(deep * 0.586)  # below the measured depths: the nearest
    cpu = Cluster.preset("cpu-gloo:2")
    assert cpu.matmul_share(8, 8, 8) == cpu.matmul_efficiency  # unmeasured: one rate for every shape
    with pytest.raises(PolyshardError, match="matmul_depth_shares"):
        dataclasses.replace(gpu, matmul_depth_shares=((1024, 0.9), (256, 0.5)))


def test_a_dtypes_measured_depth_shares_replace_the_shared_table(tmp_path):
    gpu = Cluster.preset("8xA100-80G")
    c = dataclasses.replace(gpu, matmul_shares={"bfloat16": ((64, 0.25), (1024, 1.0))})
    assert c.matmul_share(1024, 1024, 1024, "bfloat16") == 1.0  # not matmul_efficiency times the preset's table
    assert c.matmul_share(64, 1024, 1024, "bfloat16") == pytest.approx(3 / (1 / 0.25 + 1 + 1))  # one pass shallow
    assert c.matmul_share(256, 256, 256, "bfloat16") == pytest.approx(0.625)  # halfway in log depth
    assert c.matmul_share(256, 256, 256, "float32") == gpu.matmul_share(256, 256, 256)  # unmeasured dtype
    c.to_yaml(tmp_path / "c.yaml")
    assert Cluster.from_yaml(tmp_path / "c.yaml").matmul_shares == c.matmul_shares
    with pytest.raises(PolyshardError, match="matmul_shares.bfloat16"):
        dataclasses.replace(gpu, matmul_shares={"bfloat16": ((64, 0.25), (1024, 1.5))})
