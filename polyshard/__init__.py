"""polyshard: train one PyTorch model across many devices, combining every kind of parallelism.

The names below load on first use, so the command line starts without importing torch for what needs none
(``polyshard --help``) and plans without the runtime."""

import importlib

_EXPORTS = {
    "polyshard.api": ("compile", "parallelize", "plan", "shard"),
    "polyshard.errors": ("PolyshardError",),
    "polyshard.layout": ("Layout",),
    "polyshard.mesh": ("Mesh", "current_mesh", "init"),
    "polyshard.plan": ("Offload", "Optimizer", "Plan", "Precision", "Recompute", "RecomputeComm", "Schedule"),
    "polyshard.runtime": ("comm",),
    "polyshard.runtime.fusion": ("comm_fusion",),
    "polyshard.graph.stage_cuts": ("pipeline_stage",),
    "polyshard.runtime.parallel": ("ParallelModule", "micro_batch_interleaved"),
    "polyshard.runtime.pipeline": ("PipelineModule",),
    "polyshard.runtime.ps": ("PSResult", "train_ps"),
    "polyshard.compiler.recompute": ("recompute",),
    "polyshard.runtime.training_state": ("load", "save"),
    "polyshard.runtime.zero": ("ZeroOptimizer", "setup_zero"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)

# `plan` names both a submodule (Plan and its settings) and polyshard.api's function: the submodule is loaded now
# (it needs no torch), so that no later import of it rebinds the name, which then finds the function
importlib.import_module("polyshard.plan")
del globals()["plan"]


def __getattr__(name: str):
    """``from MODULE import name`` for the exported ``name``: the module's attribute, or its submodule (comm)."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'polyshard' has no attribute {name!r}")
    module = importlib.import_module(_MODULE_OF[name])
    value = getattr(module, name) if hasattr(module, name) else importlib.import_module(f"{module.__name__}.{name}")
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
