"""`polyshard k8s` manifests checked against the Kubernetes schemas and the Kubeflow PyTorchJob models."""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest
import yaml
from kubeflow.training import ApiClient

from polyshard.cli.main import _parser, main

K8S_VERSION = "1.33"


def manifests(tmp_path, *argv: str) -> list[dict]:
    out = tmp_path / "job.yaml"
    assert main(["k8s", "--image", "registry.example/polyshard:0.1", "--out", str(out), *argv]) == 0
    return list(yaml.safe_load_all(out.read_text()))


def expand(command: list[str], env: dict[str, str]) -> list[str]:
    """``$(NAME)`` replaced by the container's environment, as the kubelet does."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], part) for part in command]


def _valid_pytorchjob(job: dict) -> None:
    """Through the Kubeflow SDK's models and back unchanged (a misspelt or misplaced field would be dropped),
    and each replica's pod template against the Kubernetes schema, unknown fields refused."""
    class Response:
        data = json.dumps(job)

    client = ApiClient()
    assert client.sanitize_for_serialization(client.deserialize(Response(), "KubeflowOrgV1PyTorchJob")) == job
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": spec["template"]}, K8S_VERSION, strict=True)


def _command(doc: dict, replica: str | None = None) -> list[str]:
    spec = doc["spec"]["pytorchReplicaSpecs"][replica]["template"] if replica else doc["spec"]["template"]
    return spec["spec"]["containers"][0]["command"]


def test_train_manifest_is_a_valid_pytorchjob_running_the_local_command(tmp_path):
    flags = ["--model", "gpt-tiny", "--mesh", "dp=2,tp=2", "--steps", "3"]
    (job,) = manifests(tmp_path, "--nodes", "2", "--procs-per-node", "2", "--gpus-per-proc", "1", "train", *flags)
    _valid_pytorchjob(job)
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 1)
    assert job["spec"]["elasticPolicy"]["maxRestarts"] == 3 and job["spec"]["nprocPerNode"] == "2"
    pod = specs["Worker"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert {"name": "shm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    command = _command(job, "Master")
    assert command == _command(job, "Worker")
    assert command[:2] == ["polyshard", "train"] and command[-len(flags):] == flags
    env = {"RANK": "1", "MASTER_ADDR": "clicks-master-0", "MASTER_PORT": "23456"}  # what the operator sets
    node = _parser().parse_args(expand(command, env)[1:])
    assert (node.nnodes, node.nproc, node.node_rank, node.rdzv) == (2, 2, 1, "clicks-master-0:23456")


def test_a_pod_restarted_with_its_jobs_command_continues_from_the_newest_checkpoint(tmp_path):
    """A checkpointing job's command resumes if it finds a checkpoint (a restarted pod runs it again); a --resume
    the user gave is kept as given."""
    (job,) = manifests(tmp_path, "train", "--model", "gpt-tiny", "--save-dir", "/ck")
    assert _command(job, "Master")[-2:] == ["--resume", "if-any"]
    (job,) = manifests(tmp_path, "train", "--model", "gpt-tiny", "--save-dir", "/ck", "--resume", "auto")
    assert _command(job, "Master")[-4:] == ["--save-dir", "/ck", "--resume", "auto"]
    (job,) = manifests(tmp_path, "train", "--model", "gpt-tiny")
    assert "--resume" not in _command(job, "Master")


def test_plan_and_pins_travel_in_a_configmap_and_data_is_the_pods(tmp_path, capsys):
    plan, pins = tmp_path / "plan.json", tmp_path / "pins.yaml"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "1x2xA100-80G", "--out", str(plan)]) == 0
    pins.write_text("blocks.0.mlp.fc: {in_strategy: [[1, 1, 1], [2, 1]]}\n")
    config_map, job = manifests(tmp_path, "--procs-per-node", "2", "train", "--plan", str(plan))
    kubernetes_validate.validate(config_map, K8S_VERSION, strict=True)
    _valid_pytorchjob(job)
    assert config_map["data"] == {"plan.json": plan.read_text()}
    command = _command(job, "Master")
    assert command[command.index("--plan") + 1] == "/etc/polyshard/plan.json"
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {"name": "files", "configMap": {"name": "polyshard-files"}} in pod["volumes"]
    config_map, job = manifests(tmp_path, "--procs-per-node", "2", "train", "--mesh", "tp=2",
                                f"--strategies={pins}", "--data", "/data/tokens.bin")  # a path in the pods
    assert config_map["data"] == {"strategies.yaml": pins.read_text()}
    command = _command(job, "Master")
    assert "--strategies=/etc/polyshard/strategies.yaml" in command and "/data/tokens.bin" in command
    pins.write_text("nope.*: {in_strategy: [[2, 1]]}\n")  # checked against the model, as a local launch checks it
    capsys.readouterr()
    assert main(["k8s", "--image", "x", "--procs-per-node", "2", "train", "--mesh", "tp=2",
                 f"--strategies={pins}"]) == 2
    out = capsys.readouterr()
    assert "'nope.*' matches no module" in out.err and out.out == ""


def test_ps_manifests_are_valid_kubernetes_objects(tmp_path):
    docs = manifests(tmp_path, "--name", "clicks", "--snapshot-claim", "clicks-snapshots", "ps", "--servers", "2",
                     "--workers", "3", "--model", "recsys-tiny", "--batch-size", "6")
    assert [d["kind"] for d in docs] == ["Secret", "Service", "Job", "Job"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    servers, workers = docs[2]["spec"], docs[3]["spec"]
    assert (servers["completions"], workers["completions"]) == (2, 3)
    assert servers["template"]["spec"]["subdomain"] == docs[1]["metadata"]["name"] == "clicks-servers"
    assert {"name": "snapshots", "persistentVolumeClaim": {"claimName": "clicks-snapshots"}} in \
        servers["template"]["spec"]["volumes"]
    command = _command(docs[2])
    addresses = command[command.index("--addresses") + 1]
    assert addresses == "clicks-server-0.clicks-servers:29600,clicks-server-1.clicks-servers:29600"


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "2", "--procs-per-node", "2", "train", "--mesh", "dp=2"],
     "--nodes 2 x --procs-per-node 2: mesh dp=2 holds 2 devices but the world has 4 processes"),
    (["train", "--nproc", "2"], "--nproc is set by the manifest for each pod"),
    # the model itself, checked here as the launcher checks it before a local run
    (["--procs-per-node", "2", "train", "--model", "hf:llama", "--seq-len", "64"],
     "hf:llama takes sequences of at most 32 tokens, not 64"),
    (["--procs-per-node", "2", "train", "--mesh", "pp=2", "--virtual-stages", "3", "--schedule", "interleaved"],
     "make 6 stages, and gpt-small has 4 blocks to cut"),
    (["ps", "--role", "server"], "--role is set by the manifest"),
    (["--name", "Bad_Name", "train"], "must be a DNS label"),
    (["ps", "--servers", "2000", "--model", "recsys-tiny"], "1000 rows, fewer than the 2000 servers"),
    (["--nodes", "0", "train"], "--nodes must be at least 1"),
    (["--shm", "8 GB", "train"], "--shm '8 GB' is not a size Kubernetes reads"),
    (["ps", "--workers", "0"], "--workers must be at least 1, got 0"),
    (["--image", "", "train"], "--image '' is not an image reference"),
    (["--snapshot-claim", "snaps", "train"], "--snapshot-claim keeps the parameter servers' snapshots"),
    (["--snapshot-claim", "Bad_Claim", "ps"], "--snapshot-claim 'Bad_Claim' is not a claim name"),
    (["--nodes", "2", "ps"], "--nodes lays out train's pods"),
    (["--out", "/", "train"], "--out '/' is a folder"),
    (["--out", "no/such/dir/job.yaml", "train"], "in a folder that does not exist"),
])
def test_bad_manifest_requests_fail_with_one_line(argv, message, capsys):
    assert main(["k8s", "--image", "x", *argv]) == 2
    out = capsys.readouterr()
    assert message in out.err and out.err.count("\n") == 1 and out.out == "", out.err
