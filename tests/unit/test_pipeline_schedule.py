"""Pipeline schedules, simulation, stage cuts and timelines, in one process (no process group)."""

import dataclasses

import pytest
import torch
from torch import nn

import polyshard as ps
from polyshard import models
from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.mesh import Mesh
from polyshard.plan import Plan
from polyshard.planner.propagate import propagate
from polyshard.compiler.stages import micro_batches, pipeline_split, split_graph
from polyshard.graph.stage_cuts import stage_boundaries_of
from polyshard.planner.stages import balanced_boundaries, predict_timings
from polyshard.schedule import Action, schedule_actions, simulate, simulated_span
from polyshard.runtime.timeline import bubble_fraction, draw_timeline


def _orders(schedule, pp, m, v=1):
    return [" ".join(map(str, actions)) for actions in schedule_actions(schedule, pp, m, v)]


def test_gpipe_order():
    assert _orders("gpipe", 2, 3) == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]


def test_1f1b_order():
    # stage s: pp-1-s forwards, then forward/backward pairs, then the remaining backwards
    assert _orders("1f1b", 3, 4) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_1f1b_with_fewer_micro_batches_than_stages():
    assert _orders("1f1b", 3, 1) == ["0F0 0B0", "1F0 1B0", "2F0 2B0"]


def test_interleaved_order():
    # pp=2, v=2, m=4: rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3. Forwards take micro-batches
    # in groups of pp through the rank's first chunk, then its second; backwards visit the chunks in
    # reverse. Warm-up: (pp-s-1)*2 + (v-1)*pp forwards.
    assert _orders("interleaved", 2, 4, 2) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_action_text_round_trip():
    assert Action.parse("12B3") == Action(12, "B", 3) and str(Action(1, "F", 0)) == "1F0"
    with pytest.raises(PolyshardError, match="not CHUNK F|B MICRO"):
        Action.parse("1X0")


@pytest.mark.parametrize("args, fragment", [
    (("interleaved", 2, 4, 1), "virtual_stages >= 2"),
    (("interleaved", 2, 3, 2), "not a multiple of 2"),
    (("1f1b", 2, 4, 2), "needs schedule 'interleaved'"),
    (("zigzag", 2, 4, 1), "schedule must be one of"),
    (("gpipe", 2, 0, 1), "micro_batches must be a positive integer"),
])
def test_bad_schedules(args, fragment):
    with pytest.raises(PolyshardError, match=fragment):
        schedule_actions(*args)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_simulated_bubble_of_equal_stages(schedule, pp, m):
    times = simulate(schedule_actions(schedule, pp, m), [1.0] * pp, [2.0] * pp)
    assert bubble_fraction(times) == pytest.approx((pp - 1) / (m + pp - 1))


def test_interleaving_shrinks_the_bubble():
    pp, m, v = 4, 8, 2
    times = simulate(schedule_actions("interleaved", pp, m, v), [1.0 / v] * pp * v, [2.0 / v] * pp * v)
    assert bubble_fraction(times) == pytest.approx((pp - 1) / (v * m + pp - 1))  # Megatron-LM's (p-1)/(v m) bubble


@pytest.mark.parametrize("schedule, pp, m, v", [("gpipe", 3, 5, 1), ("1f1b", 4, 6, 1), ("1f1b", 5, 2, 1),
                                                 ("interleaved", 3, 6, 2), ("interleaved", 4, 8, 3)])
def test_the_planners_span_is_the_simulated_one(schedule, pp, m, v):
    """Unequal chunks, so that stages wait on each other: the span without records is the records' span."""
    forward = [0.5 + (7 * c % 5) / 4 for c in range(pp * v)]
    backward = [1.0 + (3 * c % 4) / 3 for c in range(pp * v)]
    times = simulate(schedule_actions(schedule, pp, m, v), forward, backward)
    assert simulated_span(schedule, pp, m, v, forward, backward) == max(t.end_s for t in times) - \
        min(t.start_s for t in times)


def test_simulation_finds_deadlocks():
    actions = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "B", 0), Action(1, "F", 0)]]
    with pytest.raises(PolyshardError, match="deadlocks; waiting: stage 0: 0B0, stage 1: 1B0"):
        simulate(actions, [1.0, 1.0], [1.0, 1.0])


def test_simulation_respects_dependencies():
    times = {(t.chunk, t.kind, t.micro): t for t in simulate(schedule_actions("1f1b", 2, 2), [1.0, 3.0], [2.0, 4.0])}
    assert times[(1, "F", 0)].start_s == 1.0 and times[(0, "F", 1)].start_s == 1.0
    assert times[(1, "B", 0)].start_s == 4.0 and times[(0, "B", 0)].start_s == 8.0


def _gpt(layers=4):
    torch.manual_seed(0)
    model = models.GPT(dataclasses.replace(models.CONFIGS["gpt-tiny"], num_layers=layers))
    return model, capture(model, model.example_inputs(2))


def test_balanced_boundaries_of_equal_blocks():
    _, gm = _gpt()
    assert balanced_boundaries(gm, 2) == ("blocks.2",)
    assert balanced_boundaries(gm, 4) == ("blocks.1", "blocks.2", "blocks.3")


class _Block(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.fc, self.proj = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.proj(torch.relu(self.fc(x)))


class _Uneven(nn.Module):
    """Four blocks, the last three times as wide inside as the others."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(16, h) for h in (64, 64, 64, 192))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_balanced_boundaries_follow_cost():
    gm = capture(_Uneven(), (torch.zeros(4, 16),))
    assert balanced_boundaries(gm, 2) == ("blocks.3",)  # 1+1+1 | 3, not 1+1 | 1+3
    with pytest.raises(PolyshardError, match="4 repeated blocks .* into 5 pipeline stages"):
        balanced_boundaries(gm, 5)


def test_split_of_a_tied_gpt():
    _, gm = _gpt()
    split = split_graph(gm, propagate(gm, (), print), ("blocks.2",))
    assert split.inputs == ((0,), (1,))  # the embedding reads the tokens, the loss the targets
    (edge,) = split.edges
    assert (edge.src, edge.dst, edge.shape, edge.dtype, edge.grad) == (0, 1, (2, 16, 32), torch.float32, True)
    assert split.tied == {"wte.weight": {0: "wte.weight", 1: "lm_head.weight"}}


def test_bad_boundaries():
    _, gm = _gpt()
    plan = propagate(gm, (), print)
    with pytest.raises(PolyshardError, match=r"\['blocks.9'\] are not modules that run in GPT; blocks are: blocks.0"):
        split_graph(gm, plan, ("blocks.9",))
    with pytest.raises(PolyshardError, match="not in the order the model runs them"):
        split_graph(gm, plan, ("blocks.3", "blocks.1"))


def test_pipeline_stage_marks():
    model, _ = _gpt()
    assert stage_boundaries_of(model) == ()
    ps.pipeline_stage(model.blocks[3], 2)
    ps.pipeline_stage(model.blocks[1], 1)
    assert stage_boundaries_of(model) == ("blocks.1", "blocks.3")
    ps.pipeline_stage(model.ln_f, 4)
    with pytest.raises(PolyshardError, match="mark each of stages 1..3 exactly once"):
        stage_boundaries_of(model)
    with pytest.raises(PolyshardError, match="integer >= 1"):
        ps.pipeline_stage(model.blocks[0], 0)


def test_micro_batches_must_divide_the_batch():
    assert [t.size(0) for t in micro_batches(torch.zeros(8, 3), 4)] == [2, 2, 2, 2]
    with pytest.raises(PolyshardError, match="micro_batches=4 does not divide the batch of 6 rows"):
        micro_batches(torch.zeros(6, 3), 4)


def test_mesh_pipeline_axis():
    m = Mesh(axes=(("dp", 2), ("pp", 2), ("tp", 2)), data_axes=("dp",), device_type="cpu", rank=5, pipeline_axis="pp")
    assert m.coords() == {"dp": 1, "pp": 0, "tp": 1}
    assert m.op_axes == (("tp", 2),) and m.num_data_shards == 2 and m.data_index == 1
    assert (m.pp, m.stage, m.stage_rank(1), m.stage_rank(0)) == (2, 0, 7, 5)
    assert str(m) == "dp=2(data) x pp=2(pipe) x tp=2(op)"
    plain = Mesh(axes=(("dp", 2),), data_axes=("dp",), device_type="cpu", rank=1)
    assert (plain.pp, plain.stage, plain.stage_rank(0)) == (1, 0, 1)
    with pytest.raises(PolyshardError, match="stage 2 is not in the 2 pipeline stages"):
        m.stage_rank(2)


def test_init_rejects_pp_as_a_data_axis():
    with pytest.raises(PolyshardError, match="'pp' is the pipeline axis"):
        ps.init({"pp": 1}, data_axes=("pp",))


def test_timeline_png(tmp_path):
    predicted = simulate(schedule_actions("1f1b", 2, 4), [1e-3, 1e-3], [2e-3, 2e-3])
    measured = simulate(schedule_actions("1f1b", 2, 4), [1e-3, 1.5e-3], [2e-3, 3e-3])
    path = tmp_path / "timeline.png"
    bubbles = draw_timeline(path, predicted, measured, title="gpt, pp=2, 1f1b")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > height > 100
    assert bubbles["predicted"] == pytest.approx(1 / 5)
    assert bubbles["measured"] == pytest.approx(bubble_fraction(measured)) and bubbles["measured"] > 0.2
    with pytest.raises(PolyshardError, match="needs predicted or measured"):
        draw_timeline(path)


def test_a_long_timeline_is_drawn_a_collection_per_stage(tmp_path, monkeypatch):
    """A cluster-scale schedule (16 stages x 8 chunks, 128 micro-batches: 32,768 boxes) is drawn as one box
    collection per stage: a collection per box made matplotlib rescale over all of them at each (minutes)."""
    from matplotlib.axes import Axes

    calls, draw = [], Axes.broken_barh

    def counted(ax, spans, *args, **kwargs):
        calls.append(len(spans))
        return draw(ax, spans, *args, **kwargs)

    monkeypatch.setattr(Axes, "broken_barh", counted)
    times = simulate(schedule_actions("interleaved", 16, 128, 8), [1e-3] * 128, [2e-3] * 128)
    draw_timeline(tmp_path / "long.png", times)
    assert len(calls) == 16 and sum(calls) == len(times) == 16 * 8 * 128 * 2


def test_plan_cuts_stages_and_predicts_timings_without_processes():
    with torch.device("meta"):
        model = models.GPT(dataclasses.replace(models.CONFIGS["gpt-tiny"], num_layers=4))
    example = model.example_inputs(8)
    pipe = Mesh(axes=(("pp", 2),), data_axes=(), device_type="cpu", rank=0, pipeline_axis="pp")
    unstaged = dataclasses.replace(propagate(capture(model, example), (), print), schedule="gpipe", micro_batches=4)
    with pytest.raises(PolyshardError, match="no stage boundaries to cut pp=2 stages at"):
        pipeline_split(model, example, unstaged, 2)
    plan = ps.plan(model, example, pipe, schedule="gpipe", micro_batches=4)
    assert plan.stage_boundaries == ("blocks.2",)
    assert pipeline_split(model, example, plan, 2)[1].chunks == 2
    staged = ps.plan(model, example, pipe, schedule="gpipe", micro_batches=4, recompute=("full", "none"))
    assert staged.stage_recompute == ("full", "none") and Plan.from_json(staged.to_json()) == staged
    with pytest.raises(PolyshardError, match=r"stage_recompute gives 3 modes .* makes 2 chunks, one mode each"):
        pipeline_split(model, example, dataclasses.replace(staged, stage_recompute=("full",) * 3), 2)
    with pytest.raises(PolyshardError, match="stage_recompute must be one of"):
        dataclasses.replace(staged, stage_recompute=("sometimes", "none"))
    times = predict_timings(model, example, plan, 2, Cluster.preset("1xA100-80G"))
    assert sorted((t.stage, t.kind, t.micro) for t in times) == sorted(
        (s, k, i) for s in range(2) for k in "FB" for i in range(4))
    assert 0.2 <= bubble_fraction(times) < 0.5  # (p-1)/(m+p-1) = 0.2 for equal stages; the head makes stage 1 longer
    with pytest.raises(PolyshardError, match="1 stage boundaries .* needs 4, so 3 boundaries"):
        predict_timings(model, example, plan, 4, Cluster.preset("1xA100-80G"))
