"""Offload: optimizer state (and its step) kept off the device, priced in copy time and the host's step.

"host": each step sends the gradients to host memory, the host steps them, and the updated parameters come back;
"disk": the state also goes to disk after the step and comes back before the next.
"""

from __future__ import annotations

from polyshard.cluster import Cluster
from polyshard.planner.cost.compute import optimizer_seconds, step_seconds

OPTIMIZER_STATE_BYTES = 8  # AdamW's two fp32 moments per parameter


def offload_seconds(param_numel: float, offload: str, cluster: Cluster, itemsize: int = 4, tensors: int = 0) -> float:
    """Seconds per step of the optimizer under ``offload`` for ``param_numel`` parameters in ``tensors`` tensors
    on this device: the copies, and the host's fp32 step over the state kept there."""
    if offload == "none":
        return 0.0
    seconds = 2 * param_numel * itemsize / cluster.host_bandwidth_bytes_per_s  # gradients down, parameters up
    if offload == "disk":  # the disk figure is a round trip: written after the step, read before the next
        seconds += 2 * param_numel * OPTIMIZER_STATE_BYTES / cluster.disk_bandwidth_bytes_per_s
    return seconds + host_step_seconds(param_numel, tensors, cluster)


def host_step_seconds(numel: float, tensors: int, cluster: Cluster) -> float:
    """The host's fp32 AdamW step over ``numel`` offloaded parameters: a CPU cluster's host is its device."""
    if cluster.device_type == "cpu":
        return optimizer_seconds(numel, "fp32", cluster, tensors)
    return step_seconds(numel, "fp32", cluster.host_memory_bandwidth_bytes_per_s, cluster.host_optimizer_overhead_s,
                        tensors)


def device_bytes_per_param(offload: str, itemsize: int = 4) -> int:
    """Bytes a parameter costs the device for training: weight and gradient, plus its optimizer
    state unless that is offloaded."""
    return 2 * itemsize + (0 if offload != "none" else OPTIMIZER_STATE_BYTES)
