"""Bad input, as a new user types it: one clear error, exit code 2, before any process starts, nothing left behind.

Each CLI case runs ``polyshard`` in this process with the launcher replaced by a failure (so an
input accepted in silence fails the case), in an empty working folder that must stay empty. A case
passes when the exit code is 2, stderr holds one error line and no traceback, the line names every
``needle`` of the case (the input, the value, and what to do), and the check took under 5 s.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import polyshard as ps
from polyshard import models
from polyshard.cli import main as cli
from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.plan import Plan
from polyshard.planner.propagate import propagate

# a refusal comes before any planning or launch: the bound catches work of minutes, not a loaded machine
# (a transformers model's refusal took over 5 s beside other jobs)
BEFORE_LAUNCH_S = 30.0


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Input files, good and broken, in a folder apart from the working one."""
    d = tmp_path_factory.mktemp("inputs")
    model = models.build("gpt-tiny", device="meta")
    plan = propagate(capture(model, model.example_inputs(8)), (("tp", 2),), lambda msg: None)
    plan = dataclasses.replace(plan, mesh=(("dp", 1), ("tp", 2)), data_axes=("dp",), model="gpt-tiny")
    (d / "tp2.json").write_text(plan.to_json())
    good = json.loads((d / "tp2.json").read_text())
    out: dict[str, str] = {"plan": str(d / "tp2.json")}

    def plan(name: str, edit) -> None:
        raw = json.loads(json.dumps(good))
        edit(raw)
        (d / f"{name}.json").write_text(json.dumps(raw))
        out[name] = str(d / f"{name}.json")

    split = next(k for k, n in good["nodes"].items() if any(l["dims"] != [[]] * len(l["dims"])
                                                            for l in n["params"].values()))
    out["split_node"] = split
    (d / "odd.bin").write_bytes(b"abc")
    (d / "big.bin").write_bytes(bytes([0, 0, 44, 1] * 100))  # uint16 ids 0 and 300
    out["odd_tokens"], out["big_tokens"] = str(d / "odd.bin"), str(d / "big.bin")
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        out["closed_port"] = str(s.getsockname()[1])
    plan("magic", lambda r: r["nodes"][split].update(impl="magic"))
    plan("local_split", lambda r: r["nodes"][split].update(impl="local"))
    plan("no_param", lambda r: r["params"].pop("blocks.0.attn.q.weight"))
    plan("extra_param", lambda r: r["params"].update({"blocks.9.w": r["params"]["wte.weight"]}))
    plan("renamed_node", lambda r: r["nodes"].update({"renamed": r["nodes"].pop(split)}))
    plan("no_node", lambda r: r["nodes"].pop(split))
    plan("foreign_axis", lambda r: r["params"]["blocks.0.attn.q.weight"].update(
        axes=[["mp", 2]], dims=[["mp"], []]))
    plan("disagree", lambda r: _flip_param(r, split))
    plan("axis_size", lambda r: r["params"]["blocks.0.attn.q.weight"].update(axes=[["tp", 4]]))
    plan("bad_schedule", lambda r: r.update(schedule="zigzag"))
    plan("pipelined_plan", lambda r: r.update(mesh=[["dp", 1], ["tp", 2], ["pp", 2]], global_batch=8))
    plan("made_for", lambda r: r.update(global_batch=8, seq_len=16))
    plan("zero_micro", lambda r: r.update(micro_batches=0))
    plan("zero_string", lambda r: r.update(zero="2"))
    plan("mesh_foo", lambda r: r.update(mesh=[["foo", 1], ["tp", 2]]))
    plan("data_axis_missing", lambda r: r.update(data_axes=["data"]))
    plan("op_axes_off_mesh", lambda r: r.update(op_axes=[["tp", 4]]))
    plan("bad_divisor", lambda r: next(n for n in r["nodes"].values() if n["shape_divisors"]).update(
        shape_divisors={"9": 2}))
    (d / "list.json").write_text("[1, 2]")
    out["list"] = str(d / "list.json")
    (d / "empty.json").write_text("{}")
    out["empty"] = str(d / "empty.json")
    (d / "notjson.json").write_text("op_axes: tp")
    out["notjson"] = str(d / "notjson.json")

    def text(name: str, body: str) -> None:
        (d / name).write_text(body)
        out[name] = str(d / name)

    text("broken.yaml", "blocks.*.mlp.fc: {in_strategy: [[1, 1], [2, 1]]\n")
    text("pad_past_vocab.json", json.dumps({"model_type": "phi3", "hidden_size": 32, "intermediate_size": 64,
                                            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64,
                                            "pad_token_id": 999}))
    text("list.yaml", "- blocks.0.mlp.fc\n")
    text("no_in.yaml", "blocks.0.mlp.fc: {out_strategy: [[1, 1]]}\n")
    text("extra_key.yaml", "blocks.0.mlp.fc: {in_strategy: [[1, 1], [2, 1]], in_stategy: [[1, 1]]}\n")
    text("nomatch.yaml", "decoder.*.fc: {in_strategy: [[1, 1], [2, 1]]}\n")
    text("uneven.yaml", "model.model.embed_tokens: {in_strategy: [[1, 1], [2, 1]], manual_split: [100, 100]}\n")
    text("dupkey.yaml", "blocks.0.mlp.fc: {in_strategy: [[1, 1], [2, 1]]}\n"
                        "blocks.0.mlp.fc: {in_strategy: [[1, 1], [1, 2]]}\n")
    text("overlap.yaml", "blocks.*.mlp.fc: {in_strategy: [[1, 1], [2, 1]]}\n"
                         "blocks.0.*: {in_strategy: [[1, 1], [1, 2]]}\n")
    text("bool.yaml", "blocks.0.mlp.fc: {in_strategy: [[1, true], [2, 1]]}\n")
    text("zero.yaml", "blocks.0.mlp.fc: {in_strategy: [[1, 1], [0, 1]]}\n")
    text("negative.yaml", "blocks.0.mlp.fc: {in_strategy: [[1, 1], [-2, 1]]}\n")
    np.save(d / "gray.npy", np.zeros((2, 1, 64, 64), dtype=np.float32))
    np.save(d / "gray.labels.npy", np.zeros((2, 64, 64), dtype=np.int64))
    out["gray.npy"] = str(d / "gray.npy")
    text("axis.yaml", "blocks.0.mlp.fc: {in_strategy: [[null, null, null], [mp, null]]}\n")
    text("indivisible.yaml", "blocks.0.attn.q: {in_strategy: [[1, 1, 1], [3, 1]]}\n")
    text("too_many.yaml", "blocks.0.mlp.fc: {in_strategy: [[1, 1, 1], [4, 1]]}\n")
    text("inputs.yaml", "blocks.0.mlp.fc: {in_strategy: [[1, 1]]}\n")
    text("rank.yaml", "blocks.0.mlp.fc: {in_strategy: [[1, 1, 1, 1], [2, 1]]}\n")
    text("string.yaml", "blocks.0.mlp.fc: {in_strategy: '2,1'}\n")
    text("empty.yaml", "")
    Cluster.preset("2xA100-80G").to_yaml(d / "cluster.yaml")
    cluster = yaml.safe_load((d / "cluster.yaml").read_text())

    def cluster_file(name: str, **edit) -> None:
        raw = json.loads(json.dumps(cluster))
        for key, value in edit.items():
            *path, last = key.split("__")
            node = raw
            for p in path:
                node = node[p]
            if value is None:
                node.pop(last)
            else:
                node[last] = value
        text(name, yaml.safe_dump(raw))

    cluster_file("negative_bw.yaml", inter_node__bandwidth_bytes_per_s=-1e9)
    cluster_file("zero_flops.yaml", flops_per_s__bfloat16=0)
    cluster_file("zero_memory.yaml", memory_bytes=0)
    cluster_file("no_devices.yaml", devices_per_node=0)
    cluster_file("unknown_key.yaml", flops=1e12)
    cluster_file("missing_key.yaml", memory_bytes=None)
    cluster_file("string_value.yaml", memory_bytes="lots")
    cluster_file("efficiency.yaml", matmul_efficiency=1.5)
    cluster_file("latency.yaml", intra_node__latency_s=-1e-6)
    text("cluster_broken.yaml", "num_nodes: [1\n")
    text("script.py", "print('hi')\n")
    text("a_file", "")
    return out


def _flip_param(raw: dict, split: str) -> None:
    """The split node's weight laid out one way in the node and another in the parameter table."""
    module = split.replace("_", ".")
    name = next(k for k in raw["params"] if k.rsplit(".", 1)[0].replace("_", ".") == module and k.endswith("weight"))
    layout = raw["params"][name]
    layout["dims"] = [layout["dims"][1], layout["dims"][0]]


TRAIN = ["train", "--nproc", "2", "--model", "gpt-tiny", "--steps", "1"]
PLAN = ["plan", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2"]
BIG_PLAN = ["plan", "--model", "gpt-125m", "--cluster", "8xA100-80G"]

# (id, argv, needles): {name} stands for the file of that name above.
CLI_CASES = [
    # meshes
    ("mesh-unknown-axis", TRAIN + ["--mesh", "foo=2"], ["foo", "dp", "tp", "pp"]),
    ("mesh-two-unknown-axes", TRAIN[:2] + ["4"] + TRAIN[3:] + ["--mesh", "data=2,model=2"], ["data", "dp"]),
    ("mesh-empty-entry", TRAIN + ["--mesh", "dp=2,,tp=2"], ["dp=2,,tp=2", "empty"]),
    ("mesh-zero-size", TRAIN + ["--mesh", "dp=2,tp=0"], ["tp=0", "at least 1"]),
    ("mesh-negative-size", TRAIN + ["--mesh", "dp=-1"], ["dp=-1", "at least 1"]),
    ("mesh-fraction", TRAIN + ["--mesh", "dp=2.5"], ["dp=2.5", "whole number"]),
    ("mesh-no-size", TRAIN + ["--mesh", "dp"], ["'dp'", "NAME=SIZE"]),
    ("mesh-twice", TRAIN + ["--mesh", "dp=1,dp=2"], ["dp", "twice"]),
    ("mesh-too-big", TRAIN + ["--mesh", "dp=4"], ["4 devices", "2 processes"]),
    ("mesh-too-small", TRAIN + ["--mesh", "tp=1"], ["1 devices", "2 processes"]),
    ("mesh-only-commas", TRAIN + ["--mesh", ",,"], ["names no axes"]),
    # machines
    ("nnodes-zero", TRAIN + ["--nnodes", "0"], ["--nnodes", "at least 1"]),
    ("node-rank-out-of-range", TRAIN + ["--nnodes", "2", "--node-rank", "2", "--rdzv", "h:29500"],
     ["--node-rank 2", "0 .. 1"]),
    ("nnodes-without-rdzv", TRAIN + ["--nnodes", "2"], ["--nnodes 2", "--rdzv"]),
    ("rdzv-no-port", TRAIN + ["--nnodes", "2", "--rdzv", "node0"], ["'node0'", "HOST:PORT"]),
    ("rdzv-port-range", TRAIN + ["--nnodes", "2", "--rdzv", "node0:99999"], ["node0:99999", "HOST:PORT"]),
    ("mesh-not-nodes-x-procs", TRAIN + ["--nnodes", "2", "--rdzv", "node0:29500", "--mesh", "dp=2"],
     ["2 devices", "4 processes"]),
    ("rdzv-unresolvable", TRAIN + ["--nnodes", "2", "--node-rank", "1", "--rdzv", "node0.invalid:29500"],
     ["'node0.invalid' does not resolve"]),
    ("rdzv-nobody-there", TRAIN + ["--nnodes", "2", "--node-rank", "1", "--rdzv", "127.0.0.1:{closed_port}",
                                   "--rdzv-timeout", "1"],
     ["machine 0 did not answer at 127.0.0.1:{closed_port} within --rdzv-timeout 1 s"]),
    ("rdzv-timeout-nan", TRAIN + ["--nnodes", "2", "--node-rank", "1", "--rdzv", "127.0.0.1:{closed_port}",
                                  "--rdzv-timeout", "nan"], ["--rdzv-timeout", "got nan"]),
    # data
    ("data-missing", TRAIN + ["--data", "{inputs}/none.bin"], ["--data", "none.bin", "not a file"]),
    ("data-odd-size", TRAIN + ["--data", "{odd_tokens}"], ["odd.bin", "3 bytes", "--data-dtype"]),
    ("data-beyond-vocab", TRAIN + ["--data", "{big_tokens}"], ["big.bin", "token id 300", "256 ids"]),
    ("tokenizer-without-data", TRAIN + ["--tokenizer", "{plan}"], ["--tokenizer", "give --data"]),
    ("data-dtype-without-data", TRAIN + ["--data-dtype", "uint32"], ["--data-dtype", "give --data"]),
    ("data-dtype-with-tokenizer", TRAIN + ["--data", "{odd_tokens}", "--tokenizer", "{plan}", "--data-dtype", "uint32"],
     ["--data-dtype", "--tokenizer writes its own"]),
    ("data-dtype-images", TRAIN[:3] + ["--model", "unet-small", "--data", "{gray.npy}", "--data-dtype", "uint32"],
     ["--data-dtype", "unet-small reads images"]),
    ("tokenizer-missing", TRAIN + ["--data", "{odd_tokens}", "--tokenizer", "{inputs}/none.json"],
     ["none.json", "neither a tokenizer.json nor a folder"]),
    # counts and numbers
    ("nproc-zero", ["train", "--nproc", "0"], ["--nproc", "at least 1"]),
    ("nproc-negative", ["train", "--nproc", "-3"], ["--nproc", "-3"]),
    ("nproc-word", ["train", "--nproc", "two"], ["--nproc", "two"]),
    ("steps-zero", TRAIN + ["--steps", "0"], ["--steps", "at least 1"]),
    ("batch-zero", TRAIN + ["--batch-size", "0"], ["--batch-size", "at least 1"]),
    ("batch-indivisible", TRAIN + ["--batch-size", "3"], ["--batch-size 3", "multiple of 2"]),
    ("accum-zero", TRAIN + ["--accum", "0"], ["--accum", "at least 1"]),
    ("accum-indivisible", TRAIN + ["--batch-size", "8", "--accum", "3"], ["--accum 3", "multiple of 6"]),
    ("lr-zero", TRAIN + ["--lr", "0"], ["--lr", "positive"]),
    ("lr-negative", TRAIN + ["--lr=-1e-3"], ["--lr", "positive"]),
    ("lr-nan", TRAIN + ["--lr", "nan"], ["--lr", "nan"]),
    ("lr-inf", TRAIN + ["--lr", "inf"], ["--lr", "inf"]),
    ("log-every-zero", TRAIN + ["--log-every", "0"], ["--log-every", "at least 1"]),
    ("seed-negative", TRAIN + ["--seed", "-1"], ["--seed", "-1"]),
    ("copies-zero", TRAIN + ["--copies", "0"], ["--copies", "'0'"]),
    ("copies-word", TRAIN + ["--copies", "many"], ["--copies", "many"]),
    ("copies-too-many", TRAIN + ["--copies", "16"], ["--copies 16", "rows"]),
    # models
    ("model-unknown", TRAIN + ["--model", "gpt-huge"], ["gpt-huge", "polyshard models"]),
    ("model-hf-family", TRAIN + ["--model", "hf:nope"], ["nope", "llama"]),
    ("model-hf-missing-file", TRAIN + ["--model", "hf:/no/such/config.json"], ["/no/such/config.json"]),
    ("model-hf-config-transformers-refuses", TRAIN + ["--model", "hf:{pad_past_vocab.json}"],
     ["transformers could not build a phi3 model", "pad_past_vocab.json", "Padding_idx"]),
    ("plan-hf-config-transformers-refuses", ["plan", "--model", "hf:{pad_past_vocab.json}", "--cluster", "cpu-gloo:2"],
     ["transformers could not build a phi3 model"]),
    ("hf-strategies-no-match", TRAIN[:3] + ["--model", "hf:llama", "--strategies", "{nomatch.yaml}"],
     ["decoder.*.fc", "model."]),
    ("hf-manual-split-short", TRAIN[:3] + ["--model", "hf:llama", "--mesh", "tp=2", "--strategies", "{uneven.yaml}"],
     ["model.model.embed_tokens", "manual_split (100, 100) adds up to 200 rows", "256"]),
    ("tp-plan-model-without-one", TRAIN[:3] + ["--model", "hf:bloom", "--mesh", "tp=2", "--tp-plan"],
     ["--tp-plan", "hf:bloom carries no tensor-parallel plan", "leave out --tp-plan"]),
    ("tp-plan-no-operator-axis", TRAIN[:3] + ["--model", "hf:llama", "--tp-plan"],
     ["--tp-plan", "{'dp': 2} has none", "--mesh dp=2,tp=2"]),
    ("tp-plan-searched", TRAIN[:3] + ["--model", "hf:llama", "--auto", "--tp-plan"],
     ["--tp-plan", "--auto", "leave out --tp-plan"]),
    # image models
    ("image-size-odd", TRAIN[:3] + ["--model", "unet-small", "--image-size", "30"], ["--image-size 30", "multiple of 4"]),
    ("image-size-zero", TRAIN[:3] + ["--model", "unet-small", "--image-size", "0"], ["--image-size", "got 0"]),
    ("image-tile-odd", TRAIN[:3] + ["--model", "unet-small", "--mesh", "h=2", "--image-size", "36"],
     ["tiles of 18 pixels", "multiple of 8"]),
    ("image-size-token-model", TRAIN + ["--image-size", "64"], ["--image-size", "gpt-tiny reads tokens"]),
    ("image-mesh-token-model", TRAIN + ["--mesh", "h=2"], ["h and w axes", "gpt-tiny reads tokens"]),
    ("image-pipeline", TRAIN[:3] + ["--model", "resnet-small", "--mesh", "pp=2"], ["a pp axis is for token models"]),
    ("image-data-shape", TRAIN[:3] + ["--model", "unet-small", "--data", "{gray.npy}"],
     ["gray.npy", "(1, 64, 64)", "(3, 64, 64)"]),
    ("hf-pp-more-than-layers", TRAIN[:2] + ["4"] + ["--model", "hf:gpt2", "--mesh", "pp=4"], ["pp=4", "hf:gpt2"]),
    ("model-shape-in-train", TRAIN + ["--model", "gpt:layers=0,hidden=32,heads=4,seq=16,vocab=64"], ["layers"]),
    ("plan-model-zero-layers", PLAN[:2] + ["gpt:layers=0,hidden=32,heads=4,seq=16,vocab=64"] + PLAN[3:],
     ["layers=0", "POSITIVE"]),
    ("plan-model-heads", PLAN[:2] + ["gpt:layers=2,hidden=30,heads=4,seq=16,vocab=64"] + PLAN[3:],
     ["hidden 30", "heads 4"]),
    ("plan-model-unknown-key", PLAN[:2] + ["gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,depth=3"] + PLAN[3:],
     ["depth=3"]),
    ("plan-model-missing-key", PLAN[:2] + ["gpt:layers=2,hidden=32"] + PLAN[3:], ["heads"]),
    ("plan-model-dropout", PLAN[:2] + ["gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=1.5"] + PLAN[3:],
     ["dropout", "1.5"]),
    # flags that need a pipeline, or each other
    ("micro-batches-without-pp", TRAIN + ["--micro-batches", "2"], ["--micro-batches", "pp"]),
    ("schedule-without-pp", TRAIN + ["--schedule", "gpipe"], ["--schedule", "pp"]),
    ("virtual-stages-without-pp", TRAIN + ["--virtual-stages", "2"], ["--virtual-stages", "pp"]),
    ("timeline-without-pp", TRAIN + ["--timeline", "t.png"], ["--timeline", "pp"]),
    ("micro-batches-zero", TRAIN + ["--mesh", "pp=2", "--micro-batches", "0"],
     ["--micro-batches", "at least 1, got 0"]),
    ("virtual-stages-word", TRAIN + ["--mesh", "pp=2", "--virtual-stages", "two"], ["--virtual-stages", "'two'"]),
    ("micro-batches-indivisible", TRAIN + ["--mesh", "pp=2", "--micro-batches", "3"], ["--micro-batches 3", "8"]),
    ("interleaved-one-stage", TRAIN + ["--mesh", "pp=2", "--schedule", "interleaved", "--virtual-stages", "1"],
     ["--virtual-stages", "2"]),
    ("pp-more-than-layers", TRAIN[:2] + ["4"] + TRAIN[3:] + ["--mesh", "pp=4"], ["pp=4", "2 blocks"]),
    ("virtual-more-than-layers", TRAIN + ["--mesh", "pp=2", "--schedule", "interleaved", "--virtual-stages", "2"],
     ["4 stages", "2 blocks"]),
    ("sequence-parallel-without-tp", TRAIN + ["--sequence-parallel"], ["--sequence-parallel", "tp"]),
    ("sequence-parallel-with-plan", TRAIN[:1] + ["--nproc", "2", "--plan", "{plan}", "--sequence-parallel"],
     ["--plan", "--sequence-parallel"]),
    ("plan-with-mesh", TRAIN + ["--plan", "{plan}", "--mesh", "tp=2"], ["--plan", "--mesh"]),
    ("auto-with-mesh", TRAIN + ["--auto", "--mesh", "dp=2"], ["--auto", "--mesh"]),
    ("plan-with-memory-limit", TRAIN + ["--plan", "{plan}", "--memory-limit", "1GiB"], ["--memory-limit"]),
    ("memory-limit-word", TRAIN + ["--memory-limit", "lots"], ["lots", "GiB"]),
    ("memory-limit-negative", TRAIN + ["--memory-limit=-1GiB"], ["-1GiB"]),
    ("memory-limit-zero", TRAIN + ["--memory-limit", "0"], ["'0'", "positive"]),
    ("memory-limit-below-parameters", TRAIN + ["--memory-limit", "64KiB"],
     ["does not fit", "parameters need 8 bytes each", "64 KiB limit", "--memory-limit"]),
    ("zero-level", TRAIN + ["--zero", "5"], ["--zero", "5"]),
    ("zero-without-dp", TRAIN + ["--mesh", "tp=2", "--zero", "1"], ["--zero", "dp"]),
    ("precision-unknown", TRAIN + ["--precision", "fp64"], ["--precision", "fp64"]),
    ("schedule-unknown", TRAIN + ["--mesh", "pp=2", "--schedule", "zigzag"], ["--schedule", "zigzag"]),
    ("optimizer-unknown", TRAIN + ["--optimizer", "adam"], ["--optimizer", "adam"]),
    ("recompute-unknown", TRAIN + ["--recompute", "all"], ["--recompute", "all"]),
    ("recompute-per-chunk-unknown", TRAIN + ["--mesh", "pp=2", "--recompute", "full/most"], ["--recompute", "most"]),
    ("recompute-per-chunk-count", TRAIN + ["--mesh", "pp=2", "--recompute", "full/full/none"],
     ["--recompute full/full/none", "3 pipeline chunks", "pp=2", "make 2"]),
    ("recompute-per-chunk-no-pipeline", TRAIN + ["--recompute", "full/none"], ["--recompute full/none", "pp=1"]),
    ("recompute-run-count", TRAIN + ["--mesh", "pp=2", "--recompute", "full*3"], ["3 pipeline chunks", "make 2"]),
    ("recompute-run-not-a-count", TRAIN + ["--mesh", "pp=2", "--recompute", "full*two"],
     ["--recompute=full*two", "'full*two' is not VALUE or VALUE*COUNT"]),
    ("recompute-comm-nothing-recomputed", TRAIN + ["--recompute-comm", "recompute"],
     ["--recompute-comm recompute", "nothing is recomputed"]),
    ("recompute-comm-recompute-none", TRAIN + ["--recompute", "none", "--recompute-comm", "keep"],
     ["--recompute-comm keep", "nothing is recomputed"]),
    ("offload-unknown", TRAIN + ["--offload", "cloud"], ["--offload", "cloud"]),
    ("offload-disk-zero", TRAIN + ["--offload", "disk", "--zero", "1"], ["--offload disk", "--zero 1"]),
    ("offload-dir-without-disk", TRAIN + ["--offload-dir", "off"], ["--offload-dir", "--offload disk"]),
    ("offload-dir-is-file", TRAIN + ["--offload", "disk", "--offload-dir", "{a_file}"], ["--offload-dir", "file"]),
    ("offload-dir-not-empty", TRAIN + ["--offload", "disk", "--offload-dir", "{inputs}"], ["--offload-dir", "empty"]),
    ("metrics-in-a-file", TRAIN + ["--metrics", "{a_file}/m.jsonl"], ["--metrics", "not a folder"]),
    ("metrics-is-folder", TRAIN + ["--metrics", "{inputs}"], ["--metrics", "folder"]),
    ("metrics-empty", TRAIN + ["--metrics", ""], ["--metrics ''", "names no file"]),
    ("timeline-in-a-file", TRAIN + ["--mesh", "pp=2", "--timeline", "{a_file}/t.png"], ["--timeline", "not a folder"]),
    # strategies YAML
    ("strategies-missing", TRAIN + ["--strategies", "nope.yaml"], ["--strategies", "nope.yaml", "does not exist"]),
    ("strategies-broken", TRAIN + ["--strategies", "{broken.yaml}"], ["broken.yaml", "line"]),
    ("strategies-list", TRAIN + ["--strategies", "{list.yaml}"], ["list.yaml", "mapping"]),
    ("strategies-empty", TRAIN + ["--strategies", "{empty.yaml}"], ["empty.yaml", "no strategies"]),
    ("strategies-no-in", TRAIN + ["--strategies", "{no_in.yaml}"], ["no_in.yaml", "in_strategy"]),
    ("strategies-misspelt-key", TRAIN + ["--strategies", "{extra_key.yaml}"], ["in_stategy"]),
    ("strategies-no-match", TRAIN + ["--strategies", "{nomatch.yaml}"], ["decoder.*.fc", "matches no module"]),
    ("strategies-duplicate", TRAIN + ["--strategies", "{dupkey.yaml}"], ["dupkey.yaml", "blocks.0.mlp.fc", "twice"]),
    ("strategies-overlap", TRAIN + ["--strategies", "{overlap.yaml}"], ["blocks.0.mlp.fc", "blocks.*.mlp.fc",
                                                                       "blocks.0.*"]),
    ("strategies-bool", TRAIN + ["--mesh", "tp=2", "--strategies", "{bool.yaml}"], ["True", "slice count"]),
    ("strategies-zero", TRAIN + ["--mesh", "tp=2", "--strategies", "{zero.yaml}"], ["0", "slice count"]),
    ("strategies-negative", TRAIN + ["--mesh", "tp=2", "--strategies", "{negative.yaml}"], ["-2", "slice count"]),
    ("strategies-string", TRAIN + ["--mesh", "tp=2", "--strategies", "{string.yaml}"], ["in_strategy", "'2,1'"]),
    ("strategies-axis", TRAIN + ["--mesh", "tp=2", "--strategies", "{axis.yaml}"], ["blocks.0.mlp.fc", "mp"]),
    ("strategies-indivisible", TRAIN + ["--mesh", "tp=2", "--strategies", "{indivisible.yaml}"],
     ["blocks.0.attn.q", "3"]),
    ("strategies-too-many-slices", TRAIN + ["--mesh", "tp=2", "--strategies", "{too_many.yaml}"],
     ["blocks.0.mlp.fc", "4"]),
    ("strategies-inputs", TRAIN + ["--mesh", "tp=2", "--strategies", "{inputs.yaml}"], ["blocks.0.mlp.fc", "2"]),
    ("strategies-rank", TRAIN + ["--mesh", "tp=2", "--strategies", "{rank.yaml}"], ["blocks.0.mlp.fc", "dims"]),
    # hand-edited plans
    ("plan-missing", TRAIN[:3] + ["--plan", "nope.json"], ["nope.json"]),
    ("plan-not-json", TRAIN[:3] + ["--plan", "{notjson}"], ["notjson.json", "JSON"]),
    ("plan-list", TRAIN[:3] + ["--plan", "{list}"], ["list.json", "object"]),
    ("plan-empty", TRAIN[:3] + ["--plan", "{empty}"], ["empty.json", "op_axes"]),
    ("plan-impl", TRAIN[:3] + ["--plan", "{magic}"], ["magic", "{split_node}", "local"]),
    ("plan-local-split", TRAIN[:3] + ["--plan", "{local_split}"], ["{split_node}", "local", "split"]),
    ("plan-dropped-param", TRAIN[:3] + ["--plan", "{no_param}"], ["blocks.0.attn.q.weight", "no layout"]),
    ("plan-extra-param", TRAIN[:3] + ["--plan", "{extra_param}"], ["blocks.9.w", "gpt-tiny"]),
    ("plan-renamed-node", TRAIN[:3] + ["--plan", "{renamed_node}"], ["renamed"]),
    ("plan-dropped-node", TRAIN[:3] + ["--plan", "{no_node}"], ["{split_node}", "no entry"]),
    ("plan-foreign-axis", TRAIN[:3] + ["--plan", "{foreign_axis}"], ["mp", "blocks.0.attn.q.weight"]),
    ("plan-layouts-disagree", TRAIN[:3] + ["--plan", "{disagree}"], ["{split_node}", "weight"]),
    ("plan-axis-size", TRAIN[:3] + ["--plan", "{axis_size}"], ["tp", "blocks.0.attn.q.weight"]),
    ("plan-schedule", TRAIN[:3] + ["--plan", "{bad_schedule}"], ["schedule", "zigzag"]),
    ("plan-micro-batches", TRAIN[:3] + ["--plan", "{zero_micro}"], ["micro_batches", "0"]),
    ("plan-zero-string", TRAIN[:3] + ["--plan", "{zero_string}"], ["zero", "'2'"]),
    ("plan-mesh-axis", TRAIN[:3] + ["--plan", "{mesh_foo}"], ["foo"]),
    ("plan-data-axis", TRAIN[:3] + ["--plan", "{data_axis_missing}"], ["data", "mesh"]),
    ("plan-op-axes", TRAIN[:3] + ["--plan", "{op_axes_off_mesh}"], ["tp", "4"]),
    ("plan-shape-divisor", TRAIN[:3] + ["--plan", "{bad_divisor}"], ["shape_divisors", "9"]),
    ("plan-world", ["train", "--nproc", "4", "--plan", "{plan}"], ["2 devices", "4 processes"]),
    ("plan-other-model", TRAIN[:3] + ["--plan", "{plan}", "--model", "gpt-small"], ["gpt-small", "gpt-tiny"]),
    ("plan-other-batch", TRAIN[:3] + ["--plan", "{made_for}", "--batch-size", "4"],
     ["made_for.json", "8 rows a step", "--batch-size 4", "--global-batch 4"]),
    ("plan-other-batch-accum", TRAIN[:3] + ["--plan", "{made_for}", "--batch-size", "8", "--accum", "2"],
     ["8 rows a step", "--batch-size 16 at --accum 2", "--batch-size 8", "--global-batch 4"]),
    ("plan-other-seq-len", TRAIN[:3] + ["--plan", "{made_for}", "--seq-len", "8"],
     ["16 tokens a row", "--seq-len 8", "leave out --seq-len"]),
    # clusters, plan and cost flags
    ("cluster-missing", PLAN[:3] + ["--cluster", "nope.yaml"], ["nope.yaml"]),
    ("cluster-preset", PLAN[:3] + ["--cluster", "8xA999"], ["A999", "A100"]),
    ("cluster-no-devices", PLAN[:3] + ["--cluster", "0x8xA100-80G"], ["0x8xA100-80G", "at 1"]),
    ("cluster-gloo-zero", PLAN[:3] + ["--cluster", "cpu-gloo:0"], ["cpu-gloo:0"]),
    ("cluster-broken", PLAN[:3] + ["--cluster", "{cluster_broken.yaml}"], ["cluster_broken.yaml"]),
    ("cluster-negative-bandwidth", PLAN[:3] + ["--cluster", "{negative_bw.yaml}"], ["bandwidth", "-1"]),
    ("cluster-zero-flops", PLAN[:3] + ["--cluster", "{zero_flops.yaml}"], ["bfloat16", "positive"]),
    ("cluster-zero-memory", PLAN[:3] + ["--cluster", "{zero_memory.yaml}"], ["memory_bytes", "positive"]),
    ("cluster-zero-devices", PLAN[:3] + ["--cluster", "{no_devices.yaml}"], ["devices_per_node"]),
    ("cluster-unknown-key", PLAN[:3] + ["--cluster", "{unknown_key.yaml}"], ["flops"]),
    ("cluster-missing-key", PLAN[:3] + ["--cluster", "{missing_key.yaml}"], ["memory_bytes"]),
    ("cluster-string-value", PLAN[:3] + ["--cluster", "{string_value.yaml}"], ["lots"]),
    ("cluster-efficiency", PLAN[:3] + ["--cluster", "{efficiency.yaml}"], ["matmul_efficiency", "1.5"]),
    ("cluster-latency", PLAN[:3] + ["--cluster", "{latency.yaml}"], ["latency_s", "-1e-06"]),
    ("plan-config-indivisible", BIG_PLAN + ["--config", "tp=3"], ["tp=3", "8"]),
    ("plan-config-key", BIG_PLAN + ["--config", "tensor=2"], ["tensor"]),
    ("plan-config-value", BIG_PLAN + ["--config", "tp=x"], ["tp", "'x'"]),
    ("plan-config-schedule", BIG_PLAN + ["--config", "schedule=zigzag"], ["zigzag"]),
    ("plan-config-cuts", BIG_PLAN + ["--config", "cuts=random"], ["cuts", "even"]),
    ("plan-global-batch", BIG_PLAN + ["--global-batch", "-4"], ["--global-batch", "-4"]),
    ("plan-global-batch-zero", BIG_PLAN + ["--global-batch", "0"], ["--global-batch", "got 0"]),
    ("plan-image-size-zero", ["plan", "--model", "unet-small", "--cluster", "8xA100-80G", "--image-size", "0"],
     ["--image-size", "got 0"]),
    ("plan-model-unknown", ["plan", "--model", "gpt-huge", "--cluster", "8xA100-80G"],
     ["gpt-huge", "gpt3-175b", "hf:FAMILY", "gpt:layers=", "polyshard models"]),
    ("plan-seq-len", BIG_PLAN + ["--seq-len", "0"], ["sequence length", "0"]),
    ("plan-memory-tiny", BIG_PLAN + ["--memory-limit", "1MiB"], ["1 MiB", "--memory-reserve"]),
    ("plan-reserve", BIG_PLAN + ["--memory-limit", "10GiB", "--memory-reserve", "20GiB"],
     ["--memory-reserve", "--memory-limit"]),
    ("plan-out-folder", BIG_PLAN + ["--out", "no/such/dir/p.json"], ["--out", "no/such/dir"]),
    ("plan-pin-missing", BIG_PLAN + ["--pin", "nope.yaml"], ["--pin", "nope.yaml"]),
    ("cost-without-config", ["cost", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2"], ["--config"]),
    ("cost-empty-config", ["cost", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2", "--config", " "],
     ["--config is empty", "polyshard plan"]),
    ("cost-mbs-indivisible", ["cost", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2", "--global-batch", "12",
                              "--config", "dp=2,mbs=4"], ["mbs=4 does not divide a replica's 6 rows", "at dp=2"]),
    ("cost-pipeline-chunks", ["cost", "--model", "gpt-tiny", "--cluster", "cpu-gloo:4", "--config", "pp=4"],
     ["pp=4 makes 4 pipeline chunks", "2 blocks"]),
    ("cost-zero-at-dp-1", ["cost", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2", "--config", "dp=1,zero=2"],
     ["zero=2", "dp=1 has one"]),
    ("cost-offload-with-zero", ["cost", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2", "--config",
                                "offload=host,zero=1"], ["offload=host", "zero=1", "leave out one of them"]),
    ("cost-offload-in-bf16", ["cost", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2", "--config",
                              "offload=disk,precision=bf16"], ["offload=disk", "precision=bf16"]),
    ("cost-zero-without-dp", ["cost", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2", "--config", "tp=2,zero=1"],
     ["dp > 1"]),
    ("explain-missing", ["explain", "nope.json"], ["nope.json"]),
    ("explain-timeline-flat", ["explain", "{plan}", "--timeline", "t.png"], ["--timeline", "pp"]),
    ("run-zero", ["run", "-n", "0", "{script.py}"], ["-n", "at least 1"]),
    ("run-missing-script", ["run", "-n", "2", "nope.py"], ["nope.py", "does not exist"]),
    ("calibrate-bad-out", ["calibrate", "--out", "{a_file}/c.yaml"], ["--out"]),
    ("calibrate-out-folder", ["calibrate", "--out", "{inputs}"], ["--out", "folder"]),
    ("calibrate-no-process", ["calibrate", "--nproc", "0"], ["--nproc", "at least 1"]),
    ("calibrate-repeats", ["calibrate", "--repeats", "0"], ["--repeats", "at least 1"]),
    ("calibrate-max-bytes", ["calibrate", "--max-bytes", "lots"], ["lots"]),
    ("copies-with-pp", TRAIN + ["--mesh", "pp=2", "--copies", "2"], ["--copies 2", "pp"]),
    ("explain-layouts", ["explain", "{plan}", "--layouts", "-1"], ["--layouts", "-1"]),
    ("explain-candidates", ["explain", "{plan}", "--candidates", "-1"], ["--candidates", "-1"]),
    ("plan-layouts", BIG_PLAN + ["--layouts", "-1"], ["--layouts", "-1"]),
    ("cost-configuration-does-not-fit", ["cost", "--model", "gpt-125m", "--cluster", "8xA100-80G", "--global-batch",
                                         "64", "--memory-limit", "3GiB", "--memory-reserve", "0", "--config",
                                         "dp=8,zero=0,recompute=none,mbs=8"],
     ["no plan that keeps dp=8,mbs=8,zero=0,recompute=none fits", "leave more settings to the search",
      "--memory-limit"]),
    ("explain-cluster", ["explain", "{plan}", "--timeline", "t.png", "--cluster", "8xA999"], ["pp"]),
    ("explain-cluster-without-timeline", ["explain", "{plan}", "--cluster", "8xA100-80G"],
     ["--cluster", "add --timeline"]),
    ("explain-timeline-folder", ["explain", "{pipelined_plan}", "--timeline", "{inputs}"], ["--timeline", "folder"]),
    ("explain-timeline-bad-cluster", ["explain", "{pipelined_plan}", "--timeline", "t.png", "--cluster", "8xA999"],
     ["A999"]),
    ("cost-virtual-stages-beyond-blocks", ["cost", "--model", "gpt-tiny", "--cluster", "8xA100-80G", "--config",
                                          "pp=2,schedule=interleaved,v=99"],
     ["pp=2,schedule=interleaved,v=99 makes 198 pipeline chunks", "2 blocks"]),
    ("cost-interleaved-beyond-blocks", ["cost", "--model", "gpt-tiny", "--cluster", "cpu-gloo:4", "--config",
                                        "schedule=interleaved"],
     ["schedule=interleaved makes at least 4 pipeline chunks", "2 blocks"]),
    ("cost-schedule-without-pipeline", ["cost", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2", "--config",
                                        "pp=1,schedule=gpipe"], ["schedule=gpipe", "pp=1 has none"]),
    ("export-out-is-file", ["export", "--out", "{a_file}", "{inputs}"], ["--out", "is a file; name a folder"]),
    ("export-out-under-file", ["export", "--out", "{a_file}/model", "{inputs}"], ["--out", "is a file"]),
    ("export-out-empty", ["export", "--out", "", "{inputs}"], ["--out ''", "names no folder"]),
    ("ps-out-is-folder", ["ps", "--model", "recsys-tiny", "--out", "{inputs}"], ["--out", "is a folder"]),
    ("ps-out-no-folder", ["ps", "--model", "recsys-tiny", "--out", "no/such/p.pt"], ["--out", "does not exist"]),
    ("ps-batch-size-zero", ["ps", "--model", "recsys-tiny", "--batch-size", "0"],
     ["--batch-size", "at least 1, got 0"]),
    ("ps-snapshot-every-zero", ["ps", "--model", "recsys-tiny", "--snapshot-every", "0"],
     ["--snapshot-every must be at least 1, got 0"]),
    ("ps-max-restarts-negative", ["ps", "--model", "recsys-tiny", "--max-restarts", "-1"],
     ["--max-restarts must be 0 or more, got -1"]),
    ("ps-resume-without-dir", ["ps", "--model", "recsys-tiny", "--resume"], ["--resume", "give their --snapshot-dir"]),
    ("ps-resume-empty-dir", ["ps", "--model", "recsys-tiny", "--resume", "--snapshot-dir", "{inputs}"],
     ["holds no server snapshots to resume from"]),
    ("ps-resume-one-role", ["ps", "--role", "server", "--resume", "--snapshot-dir", "{inputs}"],
     ["--resume continues a run started here"]),
    ("ps-straggler-async", ["ps", "--mode", "async", "--straggler-timeout", "5"], ["--straggler-timeout", "sync"]),
    ("ps-straggler-zero", ["ps", "--straggler-timeout", "0"], ["--straggler-timeout must be at least 0.1", "0.0"]),
    ("ps-staleness-sync", ["ps", "--staleness", "3"], ["--staleness", "--mode async"]),
    ("ps-staleness-negative", ["ps", "--mode", "async", "--staleness", "-1"], ["--staleness must be 0 or more", "-1"]),
    ("ps-lr-infinite", ["ps", "--lr", "inf"], ["--lr must be positive and finite", "inf"]),
    ("ps-index-without-role", ["ps", "--index", "1"], ["--index", "give --role"]),
    ("ps-addresses-without-role", ["ps", "--addresses", "h:1"], ["--addresses", "give --role"]),
    ("cost-recompute-comm-nothing-recomputed", ["cost", "--model", "gpt-tiny", "--cluster", "8xA100-80G", "--config",
                                                "recompute=none,recompute_comm=recompute"],
     ["recompute_comm=recompute", "recomputes nothing"]),
    ("plan-hf-seq-len-zero", ["plan", "--model", "hf:llama", "--cluster", "cpu-gloo:2", "--seq-len", "0"],
     ["sequence length", "got 0"]),
    ("plan-hf-seq-len-negative", ["plan", "--model", "hf:llama", "--cluster", "cpu-gloo:2", "--seq-len", "-3"],
     ["sequence length", "got -3"]),
    ("train-seq-len-zero", TRAIN + ["--seq-len", "0"], ["--seq-len", "at least 1, got 0"]),
    ("train-seq-len-image-model", ["train", "--nproc", "1", "--model", "unet-small", "--seq-len", "8"],
     ["--seq-len is for token models", "unet-small"]),
    ("train-seq-len-beyond-positions", ["train", "--nproc", "2", "--model", "hf:llama", "--seq-len", "64"],
     ["hf:llama", "at most 32 tokens", "64"]),
    ("plan-out-is-folder", ["plan", "--model", "gpt-tiny", "--cluster", "cpu-gloo:2", "--out", "{inputs}"],
     ["--out", "is a folder"]),
    ("plan-pin-broken", BIG_PLAN + ["--pin", "{broken.yaml}"], ["broken.yaml", "line 2"]),
    ("plan-pin-overlap", PLAN + ["--pin", "{overlap.yaml}"], ["blocks.0.mlp.fc", "both"]),
    ("run-folder", ["run", "-n", "2", "{inputs}"], ["folder"]),
]


def _fill(arg: str, files: dict[str, str]) -> str:
    if arg.startswith("{") and arg.endswith("}") or "{" in arg:
        for key, path in {**files, "inputs": str(Path(files["plan"]).parent)}.items():
            arg = arg.replace("{" + key + "}", path)
    return arg


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("argv,needles", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_before_launch(argv, needles, files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    def launched(*args, **kwargs):
        pytest.fail(f"launched {args}: the input was accepted")

    monkeypatch.setattr(cli, "launch", launched)
    monkeypatch.setattr("polyshard.cli.launch.launch", launched)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    before = _listing(Path(files["plan"]).parent)
    start = time.perf_counter()
    try:
        code = cli.main([_fill(a, files) for a in argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert out == "", f"printed before refusing: {out[:200]}"
    line = err[err.index("error:"):]
    for needle in needles:
        assert _fill(needle, files) in line, f"{needle!r} not named in: {line}"
    assert _listing(tmp_path) == [], "a refused run left files behind"
    assert _listing(Path(files["plan"]).parent) == before
    assert seconds < BEFORE_LAUNCH_S, f"refused after {seconds:.1f} s"


def test_debug_shows_the_traceback(files, capsys):
    code = cli.main(["--debug", "plan", "--model", "gpt-huge", "--cluster", "cpu-gloo:2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and "gpt-huge" in err


def test_cli_case_count_meets_the_battery_size():
    assert len(CLI_CASES) + len(API_CASES) >= 80


# The Python API: (id, call, needles); each raises PolyshardError before any process group work.
API_CASES = [
    ("init-negative", lambda: ps.init({"dp": -1, "tp": -2}), ["dp", "-1", "at least 1"]),
    ("init-float", lambda: ps.init({"dp": 2.0}), ["dp", "2.0", "whole number"]),
    ("init-string-size", lambda: ps.init(mesh={"dp": "2"}), ["dp", "'2'", "whole number"]),
    ("init-bool-size", lambda: ps.init({"dp": True}), ["dp", "True"]),
    ("init-unknown-axis", lambda: ps.init({"foo": 1}), ["foo", "data_axes", "op_axes"]),
    ("init-empty-entry", lambda: ps.init("dp=1,,"), ["empty"]),
    ("init-pp-as-data", lambda: ps.init({"pp": 1}, data_axes=("pp",)), ["pp", "pipeline"]),
    ("init-data-axis-missing", lambda: ps.init({"tp": 1}, data_axes=("data",)), ["data", "tp"]),
    ("init-threads", lambda: ps.init(threads_per_rank=0), ["threads_per_rank", "0"]),
    ("shard-string", lambda: ps.shard(torch.nn.Linear(2, 2), "2,1"), ["in_strategy", "'2,1'"]),
    ("shard-bool", lambda: ps.shard(torch.nn.Linear(2, 2), ((1, True), (1, 1))), ["True"]),
    ("shard-zero", lambda: ps.shard(torch.nn.Linear(2, 2), ((1, 0), (1, 1))), ["0"]),
    ("shard-object", lambda: ps.shard(3, ((1, 1),)), ["int"]),
    ("shard-mixed", lambda: ps.shard(torch.nn.Linear(2, 2), ((1, "tp"), ("tp", 1))),
     ["mixes slice counts and axis names", "a count, e.g. (1, 2)", "axis name or None, e.g. (None, 'tp')"]),
    ("comm-dim-out-of-range", lambda: ps.comm.all_gather(torch.ones(4, 8), "tp", dim=2),
     ["dim 2 is out of range", "2 dims", "(4, 8)"]),
    ("comm-split-dim-out-of-range", lambda: ps.comm.all_to_all(torch.ones(4, 8), "tp", split_dim=-3, concat_dim=0),
     ["dim -3 is out of range"]),
    ("parallelize-plan-local-split", lambda: _parallelize_edited("local"), ["local", "split", "dtensor"]),
    ("parallelize-plan-no-param", lambda: _parallelize_edited("no_param"), ["wte.weight", "no layout"]),
    ("parallelize-plan-op-axes", lambda: _parallelize_edited("op_axes"), ["tp=4", "tp=2"]),
    ("parallelize-recompute", lambda: ps.parallelize(_tiny(), recompute="most", mesh=_TP2), ["recompute", "most"]),
    ("parallelize-copies", lambda: ps.parallelize(_tiny(), copies=0, mesh=_TP2), ["copies", "0"]),
    ("parallelize-no-inputs", lambda: ps.parallelize(torch.nn.Linear(2, 2), mesh=_TP2),
     ["Linear", "example_inputs"]),
    ("parallelize-function", lambda: ps.parallelize(lambda x: x, example_inputs=(torch.ones(2),), mesh=_TP2),
     ["nn.Module", "not function"]),
    ("plan-function", lambda: ps.plan(lambda x: x, example_inputs=(torch.ones(2),), mesh=_TP2),
     ["nn.Module", "not function"]),
    ("parallelize-inputs-do-not-fit", lambda: ps.parallelize(torch.nn.Linear(4, 4, device="meta"), mesh=_TP2,
                                                             example_inputs=torch.ones(2, 5)),
     ["Linear does not run on its example inputs ([2, 5])", "[2, 5] X [4, 4]"]),
    ("plan-inputs-do-not-fit-on-cpu", lambda: ps.plan(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(2, 2)),
                                                      example_inputs=torch.ones(2, 4), mesh=_TP2),
     ["Sequential does not run on its example inputs ([2, 4])", "[2, 3] X [2, 2]"]),
    ("interleave-copies", lambda: ps.micro_batch_interleaved(_tiny(), 0), ["copies", "0"]),
    ("plan-json", lambda: Plan.from_json("{}"), ["op_axes"]),
    ("plan-schedule", lambda: Plan(op_axes=(), schedule="zigzag"), ["schedule", "zigzag"]),
]


_TP2 = ps.Mesh((("tp", 2),), ("dp",), "cpu", 0)  # a mesh object, no process group: the checks come first


def _tiny():
    return models.build("gpt-tiny", device="meta")


def _parallelize_edited(edit: str):
    """parallelize with the rules' own plan for gpt-tiny over tp=2, edited by hand."""
    model = _tiny()
    plan = propagate(capture(model, model.example_inputs(2)), _TP2.axes, lambda msg: None)
    if edit == "local":
        next(n for n in plan.nodes.values() if any(not l.is_replicated for l in n.params.values())).impl = "local"
    elif edit == "no_param":
        del plan.params["wte.weight"]
    else:
        plan = dataclasses.replace(plan, op_axes=(("tp", 4),))
    return ps.parallelize(model, example_inputs=model.example_inputs(2), plan=plan, mesh=_TP2)


@pytest.mark.parametrize("call,needles", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_refuses(call, needles, capfd):
    with pytest.raises(PolyshardError) as exc:
        call()
    for needle in needles:
        assert needle in str(exc.value), f"{needle!r} not named in: {exc.value}"
    assert capfd.readouterr().err == "", "the refusal alone says what is wrong"


def test_more_processes_than_gpus_are_refused_before_launch(monkeypatch, tmp_path, capsys):
    """Each rank takes its own GPU: four processes on a machine with two are refused before torchrun starts."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setattr("polyshard.cli.launch._Agent", lambda *a, **k: pytest.fail(f"launched {a}"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    code = cli.main(["train", "--nproc", "4", "--mesh", "dp=4", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    for needle in ("--nproc 4", "has 2", "--nproc 2", "CUDA_VISIBLE_DEVICES"):
        assert needle in err, err
    assert sorted(tmp_path.iterdir()) == []
