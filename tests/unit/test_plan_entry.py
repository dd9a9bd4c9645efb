"""ps.plan decides everything in one process (planning never imports torch.distributed); the Plan it returns
cannot be changed."""

import dataclasses
import math

import pytest
import torch

import polyshard as ps
from polyshard import models
from polyshard.cluster import Cluster
from polyshard.mesh import Mesh
from polyshard.plan import Recompute, Schedule


def _mesh(axes, data_axes=("dp",), pipeline_axis=None):
    return Mesh(axes=axes, data_axes=data_axes, device_type="cpu", rank=0, pipeline_axis=pipeline_axis,
                cluster=Cluster.preset(f"cpu-gloo:{math.prod(s for _, s in axes)}"))


def _gpt(layers=4):
    torch.manual_seed(0)
    return models.GPT(dataclasses.replace(models.CONFIGS["gpt-tiny"], num_layers=layers))


def test_plan_fills_every_decision_in_one_process():
    model = _gpt()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    plan = ps.plan(model, model.example_inputs(8), _mesh((("dp", 2), ("pp", 2)), pipeline_axis="pp"),
                   copies=1, recompute="full", schedule="gpipe", micro_batches=2, settings={"zero": 1})
    assert plan.mesh == (("dp", 2), ("pp", 2)) and plan.data_axes == ("dp",)
    assert plan.stage_boundaries == ("blocks.2",) and plan.micro_batches == 2 and plan.zero == 1
    assert plan.recompute is Recompute.FULL and plan.schedule is Schedule.GPIPE and plan.recompute == "full"
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())  # planning touches no weight
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.zero = 2


def test_plan_chooses_the_copy_count_itself():
    model = _gpt(2)
    plan = ps.plan(model, model.example_inputs(8), _mesh((("tp", 2),), data_axes=()), copies="auto")
    assert isinstance(plan.copies, int) and plan.copies >= 1
    assert dict(plan.op_axes) == {"tp": 2} and any(l.describe() for l in plan.params.values())


def test_plan_refuses_cuts_that_do_not_make_the_stages():
    model = _gpt()
    with pytest.raises(ps.PolyshardError, match="has 4 repeated blocks .* to cut into 8 pipeline stages"):
        ps.plan(model, model.example_inputs(8), _mesh((("pp", 4),), data_axes=(), pipeline_axis="pp"),
                schedule="interleaved", virtual_stages=2, micro_batches=4)


@pytest.mark.parametrize("cluster,first", [("cpu-gloo:4", 25 * 2**20), ("1x4xA100-80G", 2**20)])
def test_the_first_gradient_bucket_is_small_only_where_communication_hides(cluster, first):
    """On GPUs a small first bucket starts the gradients' all-reduce early in backward; on CPU gloo runs on the
    cores that compute, so nothing hides, and a first bucket as large as the others saves a collective."""
    model = _gpt()
    mesh = dataclasses.replace(_mesh((("dp", 4),)), cluster=Cluster.preset(cluster))
    for plan in (ps.plan(model, model.example_inputs(8), mesh), ps.plan(model, model.example_inputs(8), mesh,
                                                                       search=True)):
        assert (plan.bucket_bytes, plan.first_bucket_bytes) == (25 * 2**20, first)
    asked = ps.plan(model, model.example_inputs(8), mesh, bucket_bytes=2**19)
    assert (asked.bucket_bytes, asked.first_bucket_bytes) == (2**19, min(first, 2**19))
    kept = ps.plan(model, model.example_inputs(8), mesh, plan=dataclasses.replace(asked, first_bucket_bytes=4096))
    assert kept.first_bucket_bytes == 4096  # a given plan keeps its buckets
    assert ps.Plan.from_json(asked.to_json()).first_bucket_bytes == asked.first_bucket_bytes
