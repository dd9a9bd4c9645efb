"""Host and disk offload (heterogeneous training): what does not fit on the device lives on the host or on disk.

- ``OffloadedOptimizer``: any torch optimizer whose state, master copies and step live on the host
  (``mode="host"``) or in files streamed through the step (``mode="disk"``, see ``disk``).
- ``offload_parameters``: blocks whose parameters stay on the host and reach the device only while
  the block runs (forward, and again for backward), the next block's fetched ahead.
- ``HostEmbedding`` / ``offload_embedding``: tables looked up on the host; only the rows move.
- ``DeviceLedger``: the bytes each place holds, so a CPU-only run shows what a GPU would hold.
"""

from polyshard.runtime.offload.embedding import HostEmbedding, offload_embedding
from polyshard.runtime.offload.ledger import HOST, DeviceLedger
from polyshard.runtime.offload.optimizer import HostStore, OffloadedOptimizer
from polyshard.runtime.offload.parameters import ParameterOffload, offload_parameters

__all__ = ["DeviceLedger", "HOST", "HostEmbedding", "HostStore", "OffloadedOptimizer", "ParameterOffload",
           "offload_embedding", "offload_parameters"]
