"""Named device meshes: parse ``dp=2,tp=2``, start the process group, build DeviceMeshes.

Axes listed later are inner (consecutive ranks, hence the same node): put the axis that
talks most (tensor parallel) last so it lands on the fastest links. An axis named ``pp`` holds
pipeline stages: each stage is a mesh of its own (its collectives stay inside it), and stages
talk only point to point, rank to rank along ``pp``.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import math
import os
import re
import warnings
from dataclasses import dataclass

from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.layout import Axes

DEFAULT_DATA_AXES = ("dp",)
PIPELINE_AXIS = "pp"
SPATIAL_AXES = ("h", "w")  # an image's height and width, in the order its dims lie


# What each axis name does; the Python API takes other names when `init` is told their role.
AXIS_ROLES = {"dp": "data parallel (splits each batch)", "tp": "operator parallel (splits layers' weights)",
              "pp": "pipeline stages", "world": "operator parallel (init's default axis over all ranks)",
              "h": "spatial parallel (splits images by height)", "w": "spatial parallel (splits images by width)"}


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}``."""
    out: dict[str, int] = {}
    parts = [p.strip() for p in text.split(",")]
    if any(parts) and not all(parts[:-1]):  # a trailing comma is harmless, an empty entry a typo
        raise PolyshardError(f"mesh {text!r} has an empty entry between commas; write e.g. 'dp=2,tp=2'")
    for part in filter(None, parts):
        name, eq, size = (s.strip() for s in part.partition("="))
        if not eq or not name.isidentifier():
            raise PolyshardError(f"mesh entry {part!r} is not NAME=SIZE (e.g. 'dp=2,tp=2')")
        if not re.fullmatch(r"[+-]?[0-9]+", size):
            raise PolyshardError(f"mesh entry {part!r}: the size must be a whole number of devices, at least 1")
        out[name] = check_axis_size(name, int(size), out)
    if not out:
        raise PolyshardError(f"mesh {text!r} names no axes (e.g. 'dp=2,tp=2')")
    return out


def check_axis_size(name: object, size: object, seen: dict) -> int:
    """One mesh axis: a name not seen before and a whole number of devices, at least 1."""
    if not isinstance(name, str) or not name.isidentifier():
        raise PolyshardError(f"mesh axis name {name!r} must be an identifier such as 'dp' or 'tp'")
    if name in seen:
        raise PolyshardError(f"mesh axis {name!r} appears twice")
    if type(size) is not int:
        raise PolyshardError(f"mesh axis {name}={size!r}: the size must be a whole number of devices (an int), "
                             f"not {type(size).__name__}")
    if size < 1:
        raise PolyshardError(f"mesh axis {name}={size}: the size must be at least 1")
    return size


def check_roles(shape: dict[str, int], data_axes: tuple[str, ...], op_axes: tuple[str, ...] = (),
                where: str = "mesh") -> None:
    """Every axis has a role: a known name, or one given by ``data_axes`` / ``op_axes``."""
    unknown = [a for a in shape if a not in AXIS_ROLES and a not in data_axes and a not in op_axes]
    if unknown:
        roles = "; ".join(f"{n}: {r}" for n, r in AXIS_ROLES.items())
        raise PolyshardError(f"{where} axis {unknown[0]!r} has no role; the axes are {roles}. In Python, name an "
                             "axis of your own in init's data_axes or op_axes")


def check_mesh(shape: dict[str, int], world_size: int) -> None:
    """Raise before any process-group work if the mesh does not cover the world exactly."""
    if math.prod(shape.values()) != world_size:
        dims = " x ".join(f"{n}={s}" for n, s in shape.items())
        raise PolyshardError(
            f"mesh {dims} holds {math.prod(shape.values())} devices but the world has {world_size} "
            f"processes; choose axis sizes that multiply to {world_size}"
        )


@dataclass
class Mesh:
    """Named axes over all ranks. Data axes split batches; the pipeline axis holds stages; the
    other axes (op axes) split operators.

    axes: (name, size), outermost first. data_axes: names of the data-parallel axes.
    cluster: the machines the ranks run on (nodes, links, memory), when known.
    pipeline_axis: the axis of pipeline stages (``init`` makes ``pp`` one), or None.
    """

    axes: Axes
    data_axes: tuple[str, ...]
    device_type: str
    rank: int
    cluster: Cluster | None = None
    pipeline_axis: str | None = None

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.axes)

    @property
    def device(self):
        """Where this rank's parameters, activations and buffers live: its GPU (``init`` selects it), or the CPU."""
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")

    @property
    def op_axes(self) -> Axes:
        return tuple((n, s) for n, s in self.axes
                     if n not in self.data_axes and n != self.pipeline_axis and s > 1)

    @property
    def pp(self) -> int:
        """Pipeline stages: the pipeline axis's size (1 without one)."""
        return dict(self.axes).get(self.pipeline_axis, 1)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.coords().get(self.pipeline_axis, 0)

    def stage_rank(self, stage: int) -> int:
        """The rank holding ``stage`` with this rank's other coordinates: its peer for stage-to-stage sends."""
        if not 0 <= stage < self.pp:
            raise PolyshardError(f"stage {stage} is not in the {self.pp} pipeline stages of mesh {self}")
        coords = self.coords() | ({self.pipeline_axis: stage} if self.pipeline_axis else {})
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords[name]
        return rank

    @property
    def num_data_shards(self) -> int:
        return math.prod(s for n, s in self.axes if n in self.data_axes)

    def coords(self) -> dict[str, int]:
        """This rank's index along each axis."""
        out, rest = {}, self.rank
        for name, size in reversed(self.axes):
            out[name] = rest % size
            rest //= size
        return out

    @property
    def data_index(self) -> int:
        """This rank's position among the data shards (row-major over data axes)."""
        c = self.coords()
        idx = 0
        for name, size in self.axes:
            if name in self.data_axes:
                idx = idx * size + c[name]
        return idx

    def local_rows(self, *tensors):
        """This rank's rows of a global batch (every rank passes the same global batch), on this rank's device."""
        n, i = self.num_data_shards, self.data_index
        for t in tensors:
            if t.size(0) % n:
                raise PolyshardError(f"batch of {t.size(0)} rows does not split over {n} data shards; "
                                     f"use a multiple of {n}")
        return tuple(t.chunk(n)[i].to(self.device) for t in tensors)

    def piece(self, layout, shape) -> tuple[slice, ...]:
        """This rank's slice of each dim of a tensor of ``shape`` laid out by ``layout`` (over mesh axes;
        each split dim divides evenly)."""
        out = []
        for dim, size in enumerate(shape):
            index, count = self.piece_index(layout, dim), layout.num_shards(dim)
            out.append(slice(index * size // count, (index + 1) * size // count))
        return tuple(out)

    def piece_index(self, layout, dim: int) -> int:
        """Which of dim ``dim``'s pieces under ``layout`` this rank holds (row-major over the axes that split
        it, outermost first; 0 where it is whole)."""
        coords, sizes, index = self.coords(), layout.axis_sizes, 0
        for a in layout.dims[dim]:
            index = index * sizes[a] + coords[a]
        return index

    def device_mesh(self, op_axes: Axes | None = None):
        """The DeviceMesh over ``op_axes`` (a refinement of this mesh's op axes) for this rank."""
        op_axes = self.op_axes if op_axes is None else op_axes
        if not op_axes:
            raise PolyshardError(f"mesh {self} has no operator axes to split an operator over")
        return self._sliced(op_axes, tuple(n for n, _ in op_axes))

    def axis_mesh(self, axis: str):
        """The one-dimensional DeviceMesh along ``axis`` (data or op) through this rank."""
        size = dict(self.axes).get(axis)
        if size is None or size == 1:
            raise PolyshardError(f"axis {axis!r} of mesh {self} has no ranks to talk to; axes: {dict(self.axes)}")
        return self._sliced(self.op_axes, (axis,))

    def data_group(self):
        """The process group over the data axes (None when there is no data parallelism)."""
        if self.num_data_shards == 1:
            return None
        return self.group(self.data_axes)

    def group(self, axes: tuple[str, ...]):
        """The process group over ``axes`` (data or op axes, in any order) through this rank; made once."""
        full = self._full_mesh(self.op_axes)
        ordered = tuple(n for n in full.mesh_dim_names if n in axes)
        key = (ordered, self.axes, self.data_axes, self.pipeline_axis)
        if key not in _GROUPS:
            sub = full[ordered]
            _GROUPS[key] = (sub._flatten() if len(ordered) > 1 else sub).get_group()
        return _GROUPS[key]

    def _sliced(self, op_axes: Axes, names: tuple[str, ...]):
        """The full DeviceMesh over ``op_axes`` sliced to the axes ``names`` through this rank; made once, reused:
        slicing builds a new DeviceMesh each time, and every split op of every step asks for one."""
        key = (self._full_key(op_axes), names)
        if key not in _SLICES:
            _SLICES[key] = self._full_mesh(op_axes)[names]
        return _SLICES[key]

    def _full_key(self, op_axes: Axes) -> tuple:
        """What identifies a DeviceMesh of :func:`_full_mesh`: its axes (the pipeline axis and data axes outermost,
        then ``op_axes``) and this mesh's arrangement."""
        outer = tuple(a for a in self.axes if a[0] == self.pipeline_axis) + tuple(
            a for a in self.axes if a[0] in self.data_axes)
        return outer + op_axes, self.axes, self.data_axes, self.pipeline_axis

    def _full_mesh(self, op_axes: Axes):
        """One DeviceMesh per refinement of the op axes, the pipeline axis and data axes outermost;
        made once, reused. Slicing it by other axes keeps this rank's stage."""
        key = self._full_key(op_axes)
        full = key[0]
        outer = full[:len(full) - len(op_axes)]
        if key not in _DEVICE_MESHES:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            names = [n for n, _ in self.axes]
            order = [names.index(n) for n, _ in outer] + [i for i, n in enumerate(names) if n not in dict(outer)]
            ranks = torch.arange(self.world_size).reshape([s for _, s in self.axes]).permute(order)
            _DEVICE_MESHES[key] = DeviceMesh(
                self.device_type, ranks.reshape([s for _, s in full]), mesh_dim_names=tuple(n for n, _ in full)
            )
        return _DEVICE_MESHES[key]

    def __str__(self) -> str:
        roles = {n: "data" if n in self.data_axes else "pipe" if n == self.pipeline_axis else "op"
                 for n, _ in self.axes}
        return " x ".join(f"{n}={s}({roles[n]})" for n, s in self.axes)


_current: Mesh | None = None
_DEVICE_MESHES: dict = {}  # one DeviceMesh (and its process groups) per arrangement, per process
_GROUPS: dict = {}  # one process group per set of axes and arrangement, per process
_SLICES: dict = {}  # one sliced DeviceMesh per full mesh and axes, per process


def current_mesh() -> Mesh:
    """The mesh set by :func:`polyshard.init`; the process-wide default, like torch's default group."""
    if _current is None:
        raise PolyshardError("no mesh yet: call polyshard.init() (under torchrun or `polyshard run`) first")
    return _current


def init(mesh: dict[str, int] | str | None = None, data_axes: tuple[str, ...] = DEFAULT_DATA_AXES,
         threads_per_rank: int | None = 1, cluster: Cluster | str | None = None,
         op_axes: tuple[str, ...] = (), timeout: float | None = None, allow_all_to_all: bool = True) -> Mesh:
    """Start the process group (from torchrun's environment, or a world of one) and set the mesh.

    ``mesh=None`` gives a 1-D mesh of all ranks named ``world`` (an op axis); an axis named ``pp``
    holds pipeline stages, ``dp`` (or any name in ``data_axes``) splits batches, ``tp`` (or any name in
    ``op_axes``) splits operators; other names are refused.
    On CPU each rank uses ``threads_per_rank`` threads (1 by default: ranks share the cores).
    ``cluster`` (a preset such as ``8xA100-80G``, a YAML path, or a Cluster) defaults to torchrun's
    environment; operator axes that span nodes get a warning, since they talk the most.
    ``timeout``: seconds a collective waits for its peers before failing (None: torch's default).
    ``allow_all_to_all=False``: redistributions never use all-to-all (a split moving between dims is
    gathered and sliced), and plans made on this mesh are costed so.
    A gloo group it starts is destroyed at the interpreter's exit if the script has not destroyed it.
    """
    global _current
    import torch
    import torch.distributed as dist

    shape = parse_mesh(mesh) if isinstance(mesh, str) else _checked(dict(mesh)) if mesh else None
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    shape = shape or {"world": world_size}
    if threads_per_rank is not None and (type(threads_per_rank) is not int or threads_per_rank < 1):
        raise PolyshardError(f"threads_per_rank must be a positive int or None; got {threads_per_rank!r}")
    unknown = [a for a in data_axes if a not in shape]
    if unknown and data_axes != DEFAULT_DATA_AXES:
        raise PolyshardError(f"data axes {unknown} are not in the mesh {shape}")
    if PIPELINE_AXIS in data_axes:
        raise PolyshardError(f"{PIPELINE_AXIS!r} is the pipeline axis; it cannot be a data axis too")
    both = set(data_axes) & set(op_axes)
    if both:
        raise PolyshardError(f"axes {sorted(both)} are named as data axes and as operator axes; give each one role")
    check_roles(shape, tuple(data_axes), tuple(op_axes))
    check_mesh(shape, world_size)
    pipe = (PIPELINE_AXIS,) if PIPELINE_AXIS in shape else ()
    cluster = Cluster.load(cluster) if isinstance(cluster, str) else cluster or Cluster.from_env()
    if not allow_all_to_all:
        cluster = dataclasses.replace(cluster, all_to_all=False)
    if cluster.num_devices != world_size:
        raise PolyshardError(
            f"cluster of {cluster.num_devices} devices ({cluster.num_nodes} nodes x {cluster.devices_per_node}) "
            f"does not match the world of {world_size} processes"
        )
    _warn_if_op_axes_span_nodes(shape, tuple(data_axes) + pipe, cluster)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cpu" and threads_per_rank:
        torch.set_num_threads(threads_per_rank)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout) if timeout else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        if backend == "gloo":
            atexit.register(_release_gloo_group)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _current = Mesh(tuple(shape.items()), tuple(a for a in data_axes if a in shape), device_type, dist.get_rank(),
                    cluster, pipe[0] if pipe else None)
    return _current


def _release_gloo_group() -> None:
    """A script that leaves its gloo process group to the interpreter's end is aborted there now and then ("terminate
    called without an active exception": gloo's threads still hold tensors as the interpreter goes): release it while
    the interpreter lives. Destroying a gloo group is local to the process, so it cannot wait on a failed peer."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _checked(shape: dict) -> dict[str, int]:
    seen: dict[str, int] = {}
    for name, size in shape.items():
        seen[name] = check_axis_size(name, size, seen)
    return seen


def _warn_if_op_axes_span_nodes(shape: dict[str, int], quiet_axes: tuple[str, ...], cluster: Cluster) -> None:
    """Inner axes are consecutive ranks; operator axes beyond one node's devices cross the slow links
    (data and pipeline axes, ``quiet_axes``, talk little)."""
    inner = 1
    for name, size in reversed(shape.items()):
        if name in quiet_axes:
            break
        inner *= size
    if inner > cluster.devices_per_node:
        warnings.warn(
            f"polyshard: operator axes of {inner} devices span nodes of {cluster.devices_per_node}; "
            "keep them within a node and list them last in the mesh", stacklevel=3)
