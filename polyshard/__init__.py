"""polyshard: train one PyTorch model across many devices, combining every kind of parallelism."""

from polyshard.api import compile, parallelize, plan, shard  # noqa: A004
from polyshard.errors import PolyshardError
from polyshard.layout import Layout
from polyshard.mesh import Mesh, current_mesh, init
from polyshard.plan import Offload, Optimizer, Plan, Precision, Recompute, RecomputeComm, Schedule
from polyshard.runtime import comm
from polyshard.runtime.fusion import comm_fusion
from polyshard.graph.stage_cuts import pipeline_stage
from polyshard.runtime.parallel import ParallelModule, micro_batch_interleaved
from polyshard.runtime.pipeline import PipelineModule
from polyshard.runtime.ps import PSResult, train_ps
from polyshard.compiler.recompute import recompute
from polyshard.runtime.training_state import load, save
from polyshard.runtime.zero import ZeroOptimizer, setup_zero

__all__ = ["comm", "comm_fusion", "compile", "Layout", "Mesh", "Offload", "Optimizer", "ParallelModule", "Plan", "Precision", "Recompute", "RecomputeComm", "Schedule", "PolyshardError", "current_mesh", "init", "load", "micro_batch_interleaved", "parallelize", "pipeline_stage", "PipelineModule", "plan", "PSResult", "recompute", "save", "setup_zero", "shard", "train_ps", "ZeroOptimizer"]
