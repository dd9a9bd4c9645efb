"""Pipeline parallel at run time: a module of this rank's chunks (``module.py``) and the executor of one
step's schedule (``executor.py``)."""

from polyshard.runtime.pipeline.module import PipelineModule, compile_pipeline

__all__ = ["PipelineModule", "compile_pipeline"]
