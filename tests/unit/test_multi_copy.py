"""Interleaving copies in one process, and the cost model's choice of how many."""

import dataclasses

import pytest
import torch

import polyshard as ps
from polyshard import models
from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.planner.cost.overlap import OpCost, choose_copies, step_seconds
from polyshard.planner.propagate import propagate
from polyshard.compiler.interleave import interleave, merge_outputs


def test_interleaved_graph_equals_the_model_on_uneven_slices():
    torch.manual_seed(0)
    model = models.build("gpt-tiny").double()
    x = torch.randint(0, 256, (5, 16))
    gm = capture(model, (x, x))
    ref = model(x, x)
    ref.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    out = interleave(gm, 3)(x, x)  # slices of 2, 2 and 1 rows
    out.backward()
    assert torch.allclose(out, ref, rtol=1e-12)
    for k, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[k], rtol=1e-10, atol=1e-14), k


def test_more_copies_than_rows_is_a_clear_error():
    model = models.build("gpt-tiny")
    x = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(PolyshardError, match="batch of 2 rows cannot feed 3 copies"):
        interleave(capture(model, (x, x)), 3)(x, x)


def test_merge_weights_losses_by_rows_and_concatenates_batches():
    merged = merge_outputs([(torch.tensor(1.0), torch.ones(2, 3)), (torch.tensor(4.0), torch.zeros(1, 3))], [2, 1])
    assert merged[0].item() == pytest.approx(2.0) and merged[1].shape == (3, 3)


def test_step_time_hides_communication_behind_the_other_copy():
    costs = [OpCost(compute_s=1.0, comm_s=1.0, latency_s=0.0)] * 4
    assert step_seconds(costs, 1) == pytest.approx(8.0)  # compute, then wait, four times
    assert step_seconds(costs, 2) == pytest.approx(4.5)  # all but the last half-collective hidden
    # compute beside a collective runs 1.5x longer: every half-op but the first has a half-second collective
    # beside it, so does a third of its work there and the rest after, a sixth of a second late
    assert step_seconds(costs, 2, slowdown=0.5) == pytest.approx(4.5 + 7 / 6)
    assert step_seconds(costs, 1, slowdown=0.5) == pytest.approx(8.0)  # one copy waits: nothing runs beside


def _plan_for(cfg, rows):
    model = models.GPT(cfg).to("meta")
    gm = capture(model, model.example_inputs(rows))
    plan = propagate(gm, (("tp", 4),), lambda msg: None)
    return gm, dataclasses.replace(plan, mesh=(("tp", 4),))


def test_on_cpu_nothing_hides_so_one_copy_wins():
    cfg = dataclasses.replace(models.CONFIGS["gpt-tiny"], hidden=512, num_heads=8, seq_len=128)
    chosen, predicted = choose_copies(*_plan_for(cfg, 8), Cluster.preset("cpu-gloo:4"), 8)
    assert chosen == 1 and predicted[1] < predicted[2] < predicted[4]


def test_on_gpus_a_large_layer_is_worth_splitting():
    cfg = dataclasses.replace(models.CONFIGS["gpt-tiny"], hidden=4096, num_heads=32, seq_len=2048)
    chosen, predicted = choose_copies(*_plan_for(cfg, 8), Cluster.preset("4xA100-80G"), 8)
    assert chosen > 1 and predicted[chosen] < predicted[1]
    tiny = choose_copies(*_plan_for(models.CONFIGS["gpt-tiny"], 8), Cluster.preset("4xA100-80G"), 8)
    assert tiny[0] == 1  # launch overhead dominates a tiny model


def test_micro_batch_interleaved_marks_models_and_rejects_bad_counts():
    model = models.build("gpt-tiny")
    assert ps.micro_batch_interleaved(model, copies=2) is model and model._polyshard_copies == 2
    with pytest.raises(PolyshardError, match="positive integer"):
        ps.micro_batch_interleaved(model, copies=0)
