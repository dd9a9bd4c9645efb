"""``polyshard k8s``: the Kubernetes manifests that run a ``polyshard train`` or ``polyshard ps`` command on a cluster.

train: a Kubeflow Training Operator ``PyTorchJob`` (a Master and N-1 Worker pods, each running
``polyshard train --nnodes N --node-rank $(RANK) --rdzv $(MASTER_ADDR):$(MASTER_PORT)``). ps: PyTorchJob has
no server replica type, so a parameter-server job is core Kubernetes: an Indexed Job of servers behind a
headless Service (stable names server-0.., restarted in place from their snapshots), an Indexed Job of
workers, and a Secret with the run's key.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import secrets
from pathlib import Path

import yaml

from polyshard.cli.train_args import train_config
from polyshard.errors import PolyshardError, check_output_file

PS_PORT = 29600
MASTER_PORT = 23456  # the Training Operator's default PyTorchJob port
FILES_MOUNT = "/etc/polyshard"
SNAPSHOT_MOUNT = "/snapshots"
INDEX_ENV = "POLYSHARD_INDEX"
ROLE_FLAGS = ("--role", "--index", "--addresses", "--snapshot-dir")  # the manifest sets these for each pod
NODE_FLAGS = ("--nproc", "--nnodes", "--node-rank", "--rdzv", "--max-restarts")
CONFIG_FILES = {"--plan": "plan.json", "--strategies": "strategies.yaml"}  # train flags naming files pods need


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``k8s`` on the ``polyshard`` subcommands."""
    p = sub.add_parser("k8s", help="write Kubernetes manifests that run a train or ps command on a cluster",
                       description="Write the manifests for `polyshard k8s [flags] train|ps [their flags]`: a "
                                   "Kubeflow PyTorchJob for train, a server Job, worker Job, Service and Secret for "
                                   "ps. Apply them with `kubectl apply -f FILE`.")
    p.add_argument("--image", required=True, help="container image with polyshard installed")
    p.add_argument("--name", default="polyshard", help="job name, a DNS label (default polyshard)")
    p.add_argument("--nodes", type=int, default=1, help="train: pods, one per machine (default 1)")
    p.add_argument("--procs-per-node", type=int, default=1, help="train: processes per pod (default 1)")
    p.add_argument("--gpus-per-proc", type=int, default=0, help="GPUs each process gets (default 0: CPU)")
    p.add_argument("--shm", default="8Gi", help="shared memory per pod, for the data loaders and NCCL (default 8Gi)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts of a failed pod before the job fails "
                   "(default 3)")
    p.add_argument("--snapshot-claim", default="", help="ps: a PersistentVolumeClaim for the servers' snapshots, so "
                   "they survive a lost pod (default: a pod-local folder, kept across container restarts)")
    p.add_argument("--out", default="-", help="write the YAML here (default: print it)")
    p.add_argument("command", choices=["train", "ps"], help="the polyshard command the pods run")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="that command's flags, as for a local run")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    _check_common(args)
    docs = _train_job(args) if args.command == "train" else _ps_job(args)
    text = yaml.dump_all(docs, Dumper=_PlainDumper, sort_keys=False)
    if args.out == "-":
        print(text, end="")
    else:
        Path(args.out).write_text(text)
        print(f"polyshard k8s: {len(docs)} manifest(s) written to {args.out}; apply with `kubectl apply -f {args.out}`")
    return 0


def _check_common(args: argparse.Namespace) -> None:
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?", args.name):
        raise PolyshardError(f"--name {args.name!r} must be a DNS label: lower-case letters, digits and '-', at most "
                             "42 characters")
    if not re.fullmatch(r"\d+(\.\d+)?([KMGTPE]i|[kMGTPE])?", args.shm):  # a Kubernetes quantity of bytes
        raise PolyshardError(f"--shm {args.shm!r} is not a size Kubernetes reads: a number with an optional unit "
                             "such as 8Gi, 512Mi or 2G")
    if not args.image or any(c.isspace() for c in args.image):
        raise PolyshardError(f"--image {args.image!r} is not an image reference; name one such as "
                             "registry.example/polyshard:1.0")
    if args.snapshot_claim and args.command != "ps":
        raise PolyshardError("--snapshot-claim keeps the parameter servers' snapshots; it applies to ps, not train")
    if args.snapshot_claim and not re.fullmatch(r"[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?", args.snapshot_claim):
        raise PolyshardError(f"--snapshot-claim {args.snapshot_claim!r} is not a claim name: lower-case letters, "
                             "digits, '-' and '.', at most 253 characters")
    spread = [f for f, value in (("--nodes", args.nodes), ("--procs-per-node", args.procs_per_node)) if value != 1]
    if spread and args.command == "ps":
        raise PolyshardError(f"{spread[0]} lays out train's pods; ps runs one pod per server and worker "
                             "(set their counts with ps's --servers and --workers)")
    if args.out != "-":
        check_output_file("--out", args.out)
    for flag, value, least in (("--nodes", args.nodes, 1), ("--procs-per-node", args.procs_per_node, 1),
                               ("--gpus-per-proc", args.gpus_per_proc, 0), ("--max-restarts", args.max_restarts, 0)):
        if value < least:
            raise PolyshardError(f"{flag} must be at least {least}, got {value}")
    given = [f for f in args.flags if f.split("=")[0] in ROLE_FLAGS + NODE_FLAGS]
    if given:
        raise PolyshardError(f"{given[0].split('=')[0]} is set by the manifest for each pod; leave it out of the "
                             f"{args.command} flags")


def _parse(parser: argparse.ArgumentParser, command: str, flags: list[str]) -> argparse.Namespace:
    """The command's flags, parsed and checked as the pods will parse them (bad flags fail here, not in the pods)."""
    try:
        return parser.parse_args([command, *flags])
    except SystemExit as exc:
        raise PolyshardError(f"the {command} flags {' '.join(flags)!r} do not parse (see above)") from exc


def _train_job(args: argparse.Namespace) -> list[dict]:
    from polyshard.train.config import check_against_model, check_config

    train = _parse(args.parser, "train", args.flags)
    world = args.nodes * args.procs_per_node
    try:  # --data and --tokenizer name files inside the pods (on a volume you mount): not looked for here
        cfg, shape, plan = check_config(dataclasses.replace(train_config(train), data="", tokenizer=""), world)
    except PolyshardError as exc:  # e.g. a mesh that is not nodes x procs
        raise PolyshardError(f"--nodes {args.nodes} x --procs-per-node {args.procs_per_node}: {exc}") from None
    # the model itself, as the pods will build it: its checkpoints live on their volumes, and whether it fits is
    # for their devices to say, not this machine's
    check_against_model(dataclasses.replace(cfg, resume="", save_dir="", auto=False, memory_limit=""), shape, plan,
                        args.nodes)
    docs = []
    mounts, volumes = [_shm_mount()], [_shm_volume(args.shm)]
    files = {key: Path(getattr(train, flag[2:])).read_text() for flag, key in CONFIG_FILES.items()
             if getattr(train, flag[2:])}
    flags = _with_paths(args.flags, {flag: f"{FILES_MOUNT}/{key}" for flag, key in CONFIG_FILES.items()
                                     if key in files})
    if files:  # the plan and pins travel with the job, mounted where the command reads them
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{args.name}-files"},
                     "data": files})
        mounts.append({"name": "files", "mountPath": FILES_MOUNT, "readOnly": True})
        volumes.append({"name": "files", "configMap": {"name": f"{args.name}-files"}})
    command = ["polyshard", "train", "--nproc", str(args.procs_per_node)]
    if args.nodes > 1:
        command += ["--nnodes", str(args.nodes), "--node-rank", "$(RANK)", "--rdzv", "$(MASTER_ADDR):$(MASTER_PORT)"]
    if train.save_dir and not train.resume:  # a pod restarted with the job's command continues the run
        flags += ["--resume", "if-any"]
    command += ["--max-restarts", str(args.max_restarts), *flags]

    def replica(count: int, port: bool) -> dict:
        container = {"name": "pytorch", "image": args.image, "command": command, "volumeMounts": mounts,
                     "resources": _resources(args.procs_per_node * args.gpus_per_proc)}
        if port:
            container["ports"] = [{"name": "pytorchjob-port", "containerPort": MASTER_PORT}]
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": {"polyshard/job": args.name}},
                             "spec": {"containers": [container], "volumes": volumes}}}

    specs = {"Master": replica(1, port=True)}
    if args.nodes > 1:
        specs["Worker"] = replica(args.nodes - 1, port=False)
    docs.append({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": args.name},
                 "spec": {"elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": args.nodes,
                                            "maxReplicas": args.nodes, "maxRestarts": args.max_restarts},
                          "nprocPerNode": str(args.procs_per_node),
                          "runPolicy": {"backoffLimit": args.max_restarts, "cleanPodPolicy": "None"},
                          "pytorchReplicaSpecs": specs}})
    return docs


def _with_paths(flags: list[str], paths: dict[str, str]) -> list[str]:
    """``flags`` with the value of each flag in ``paths`` replaced (``--flag VALUE`` or ``--flag=VALUE``)."""
    out = list(flags)
    for i, flag in enumerate(out):
        name = flag.split("=")[0]
        if name in paths:
            if "=" in flag:
                out[i] = f"{name}={paths[name]}"
            else:
                out[i + 1] = paths[name]
    return out


def _ps_job(args: argparse.Namespace) -> list[dict]:
    from polyshard.cli.ps import KEY_ENV, job_of
    from polyshard.runtime.ps.launch import check
    from polyshard.runtime.ps.spec import PSSpec

    ps = _parse(args.parser, "ps", args.flags)
    servers, workers = ps.servers, ps.workers
    check(PSSpec(servers=(("", 0),) * servers, key=b"", snapshot_dir="", **job_of(ps)), servers, ps.max_restarts)
    service = f"{args.name}-servers"
    addresses = ",".join(f"{args.name}-server-{i}.{service}:{PS_PORT}" for i in range(servers))
    role_flags = ["--index", f"$({INDEX_ENV})", "--addresses", addresses]
    key_env = {"name": KEY_ENV, "valueFrom": {"secretKeyRef": {"name": f"{args.name}-key", "key": "key"}}}
    index_env = {"name": INDEX_ENV, "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    snapshots = ({"persistentVolumeClaim": {"claimName": args.snapshot_claim}} if args.snapshot_claim
                 else {"emptyDir": {}})

    def job(role: str, count: int, extra: list[str], mounts: list[dict], volumes: list[dict]) -> dict:
        container = {"name": role, "image": args.image, "env": [key_env, index_env],
                     "command": ["polyshard", "ps", *args.flags, "--role", role, *role_flags, *extra],
                     "volumeMounts": [_shm_mount(), *mounts], "resources": _resources(args.gpus_per_proc)}
        if role == "server":
            container["ports"] = [{"name": "ps", "containerPort": PS_PORT}]
        pod = {"restartPolicy": "OnFailure", "containers": [container], "volumes": [_shm_volume(args.shm), *volumes]}
        if role == "server":
            pod["subdomain"] = service  # pods are then reachable as <job>-<index>.<service>
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{args.name}-{role}"},
                "spec": {"completionMode": "Indexed", "completions": count, "parallelism": count,
                         "backoffLimit": args.max_restarts * count,
                         "template": {"metadata": {"labels": {"polyshard/job": args.name, "polyshard/role": role}},
                                      "spec": pod}}}

    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{args.name}-key"},
         "stringData": {"key": secrets.token_hex(32)}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": service},
         "spec": {"clusterIP": "None", "selector": {"polyshard/job": args.name, "polyshard/role": "server"},
                  "ports": [{"name": "ps", "port": PS_PORT}]}},
        job("server", servers, ["--snapshot-dir", SNAPSHOT_MOUNT],
            [{"name": "snapshots", "mountPath": SNAPSHOT_MOUNT}], [{"name": "snapshots", **snapshots}]),
        job("worker", workers, [], [], []),
    ]


class _PlainDumper(yaml.SafeDumper):
    """Writes shared lists out in full: no YAML anchors and aliases, which some tools reject."""

    def ignore_aliases(self, data) -> bool:
        return True


def _resources(gpus: int) -> dict:
    return {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}


def _shm_mount() -> dict:
    return {"name": "shm", "mountPath": "/dev/shm"}


def _shm_volume(size: str) -> dict:
    return {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}
