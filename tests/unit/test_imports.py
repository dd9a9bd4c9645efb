"""The package's import graph: no module reaches itself again, and planning never touches torch.distributed."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import polyshard

ROOT = Path(polyshard.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Each polyshard module's imports of other polyshard modules, at module level or inside functions."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                members = {f"{node.module}.{a.name}" for a in node.names}
                found |= members if members <= names.keys() else {node.module, *members}  # modules, or names
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {n for n in found if n in names and n != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, or [] (depth-first search for a back edge)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_module_imports_itself_through_others():
    graph = _imports()
    assert len(graph) > 50  # the walk found the package
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_planning_and_capture_never_import_torch_distributed():
    for package in ("planner", "graph"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                assert not any(m.startswith("torch.distributed") for m in modules), path


VOCABULARY = ("errors", "layout", "plan", "transitions", "halo", "pin", "cluster", "mesh", "schedule", "buckets")


# each layer of the pipeline, with what it must never import: planning never reaches compiling or running, and
# the runtime executes what it is handed without consulting the planner
FORBIDDEN = {
    "graph": {"planner", "compiler", "runtime", "train", "cli", "api"},
    "planner": {"compiler", "runtime", "train", "cli", "api"},
    "compiler": {"runtime", "train", "cli", "api"},
    "runtime": {"planner", "train", "cli", "api"},
    "train": {"cli"},
}


def test_each_layer_imports_only_those_below_it():
    """Capture (graph/) sits under planning, planning under compiling, compiling under running, and the shared
    vocabulary (layouts, the Plan, meshes) under everything: none imports a layer above it."""
    graph = _imports()
    for layer, forbidden in FORBIDDEN.items():
        above = sorted(f"{n} -> {m}" for n, found in graph.items() if n.split(".")[1:2] == [layer] for m in found
                       if m.split(".")[1:2] and m.split(".")[1] in forbidden)
        assert above == [], above
    for name in VOCABULARY:
        assert {m.split(".")[1] for m in graph[f"polyshard.{name}"]} <= set(VOCABULARY), name


def _fresh(code: str) -> str:
    """What ``code`` prints in a new interpreter (this one has torch loaded already)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=ROOT.parent).stdout.strip()


def test_the_command_line_starts_without_torch():
    """`polyshard --help` and every command's flags come up without loading torch (seconds on a small machine)."""
    assert _fresh("import sys; from polyshard.cli.main import _parser; _parser().format_help(); "
                  "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))") == "[]"


def test_the_launchers_checks_load_neither_dtensor_nor_the_runtime():
    """`polyshard train` checks its flags, model and plan before it starts any rank: that needs the model and
    its capture, not DTensor (a second on a small machine) or the runtime that the ranks load."""
    assert _fresh("import sys; import polyshard.train.config; print(sorted(m for m in ('torch.distributed.tensor', "
                  "'polyshard.api', 'polyshard.runtime.parallel') if m in sys.modules))") == "[]"


def test_the_package_names_load_on_first_use():
    import polyshard.api
    from polyshard.plan import Plan

    assert polyshard.plan is polyshard.api.plan and polyshard.Plan is Plan  # the function, not the Plan module
    assert polyshard.comm.__name__ == "polyshard.runtime.comm"
    assert all(getattr(polyshard, name) is not None for name in polyshard.__all__)
    assert set(polyshard.__all__) <= set(dir(polyshard))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        polyshard.nothing  # noqa: B018
    # a fresh process that loads the Plan module before the function still finds the function
    assert _fresh("import polyshard.plan, polyshard; print(callable(polyshard.plan))") == "True"


def test_a_model_built_on_meta_fills_nothing_and_keeps_its_shapes():
    """On meta a model's init fills are skipped (torch would run them through its Python references, loading
    torch._dynamo); the shapes are the model's, and a model built elsewhere is filled as before."""
    import torch

    from polyshard import models

    assert _fresh("import sys; from polyshard import models; models.build('gpt-tiny', device='meta'); "
                  "print('torch._dynamo' in sys.modules)") == "False"
    meta, real = models.build("gpt-tiny", device="meta"), models.build("gpt-tiny", seed=3)
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    torch.manual_seed(3)
    with torch.device("cpu"):
        again = models.GPT(real.cfg)
    assert all(torch.equal(a, b) for a, b in zip(real.parameters(), again.parameters()))
    assert real.wte.weight.std() > 0
