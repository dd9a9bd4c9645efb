"""Offload: optimizer state (and its step) kept off the device, priced in copy time.

"host": each step sends the gradients to host memory and the updated parameters back;
"disk": the state also goes to disk after the step and comes back before the next.
"""

from __future__ import annotations

from polyshard.cluster import Cluster

OPTIMIZER_STATE_BYTES = 8  # AdamW's two fp32 moments per parameter


def offload_seconds(param_numel: float, offload: str, cluster: Cluster, itemsize: int = 4) -> float:
    """Extra seconds per step for ``param_numel`` parameters on this device under ``offload``."""
    if offload == "none":
        return 0.0
    seconds = 2 * param_numel * itemsize / cluster.host_bandwidth_bytes_per_s  # gradients down, parameters up
    if offload == "disk":  # the disk figure is a round trip: written after the step, read before the next
        seconds += 2 * param_numel * OPTIMIZER_STATE_BYTES / cluster.disk_bandwidth_bytes_per_s
    return seconds


def device_bytes_per_param(offload: str, itemsize: int = 4) -> int:
    """Bytes a parameter costs the device for training: weight and gradient, plus its optimizer
    state unless that is offloaded."""
    return 2 * itemsize + (0 if offload != "none" else OPTIMIZER_STATE_BYTES)
