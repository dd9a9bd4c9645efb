"""Pipeline parallel parity: steps on a mesh with a ``pp`` axis (alone, and with dp and tp) equal the
same steps on one device; 1F1B bounds the activations the first stage holds.

As in test_parity: AdamW in float64 (Adam amplifies rounding noise on near-zero gradients),
SGD in float32.
"""

import pytest
import torch

from tests.distributed import pipeline_cases as cases

TOL = 1e-5
SCHEDULES = ["gpipe", "1f1b"]


def _check(results):
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL and r["tied_gap"] == 0.0, r


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2(pools, schedule):
    results = pools(2).run(cases.gpt_parity, "pp=2", schedule)
    _check(results)
    assert results[0]["boundaries"] == ("blocks.2",)  # balanced: two blocks a stage
    assert results[0]["tied"] == ["wte.weight"]  # embedding on stage 0, tied head on stage 1
    assert "wte.weight" in results[0]["params"] and "wte.weight" in results[1]["params"]
    assert "blocks.0.attn.q.weight" in results[0]["params"] and "blocks.0.attn.q.weight" not in results[1]["params"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_sgd_float32(pools, schedule):
    _check(pools(2).run(cases.gpt_parity, "pp=2", schedule, torch.float32, "sgd"))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp4(pools, schedule):
    results = pools(4).run(cases.gpt_parity, "pp=4", schedule)
    _check(results)  # the middle stages trained on zeros, as the trainer hands them: they read no data
    assert results[0]["boundaries"] == ("blocks.1", "blocks.2", "blocks.3")
    assert [r["reads_batch"] for r in results] == [True, False, False, True]


@pytest.mark.parametrize("mesh", ["dp=2,pp=2", "pp=2,tp=2"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_with_dp_or_tp(pools, mesh, schedule):
    _check(pools(4).run(cases.gpt_parity, mesh, schedule))


def test_pp2_tp2_sgd_float32(pools):
    _check(pools(4).run(cases.gpt_parity, "pp=2,tp=2", "1f1b", torch.float32, "sgd"))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dp2_pp2_tp2(pools, schedule):
    _check(pools(8).run(cases.gpt_parity, "dp=2,pp=2,tp=2", schedule))


def test_stages_lay_their_operators_out_differently(pools):
    """Pins per stage: the first stage uses its tp axis for rows (its weights whole), the second for weights."""
    results = pools(4).run(cases.stage_layouts_parity)
    _check(results)
    layouts = results[0]["layouts"]
    assert results[0]["boundaries"] == ("blocks.1",)
    # the first stage's MLP computes a half of the rows on each rank, the second's a half of the features
    assert results[0]["fc_outputs"] == {"blocks_0_mlp_fc": "tp=2:S(0)", "blocks_1_mlp_fc": "tp=2:S(2)"}
    assert layouts["blocks.0.mlp.fc.weight"] == "tp=2:R" and layouts["blocks.0.attn.proj.weight"] == "tp=2:R"
    assert layouts["blocks.1.mlp.fc.weight"] == "tp=2:S(0)" and layouts["blocks.1.mlp.proj.weight"] == "tp=2:S(1)"


@pytest.mark.parametrize("tp_split", [("rows", "ops"), ("ops", "rows"), ("rows", "rows")])
def test_stages_whose_tp_ranks_split_rows_train_as_one_device(pools, tp_split):
    """A sub-mesh per stage: a chunk whose tp ranks split rows runs its tp axis as a second data axis, every weight
    whole but the tied table, which keeps the vocabulary split the head's chunk gives it."""
    results = pools(4).run(cases.tp_split_parity, tp_split)
    _check(results)
    r = results[0]
    for block, split in enumerate(tp_split):
        assert r["fc"][f"blocks_{block}_mlp_fc"] == ("tp=2:S(0)" if split == "rows" else "tp=2:S(2)")
        assert r["layouts"][f"blocks.{block}.mlp.fc.weight"] == ("tp=2:R" if split == "rows" else "tp=2:S(0)")
    assert r["layouts"]["wte.weight"] == "tp=2:S(0)"


def test_a_searched_chunk_whose_tp_ranks_split_rows_trains_as_one_device(pools):
    """The search, with the last chunk fixed to split rows, lays out and cuts a plan that trains as one device."""
    results = pools(4).run(cases.searched_tp_split_parity, "ops/rows", False)
    _check(results)
    assert results[0]["tp_split"] == ("ops", "rows")
    assert results[0]["fc"]["blocks_3_mlp_fc"] == "tp=2:S(0)" and results[0]["fc"]["blocks_0_mlp_fc"] != "tp=2:S(0)"
    assert results[0]["layouts"]["blocks.3.mlp.fc.weight"] == "tp=2:R"


def test_interleaved_two_virtual_stages(pools):
    results = pools(2).run(cases.gpt_parity, "pp=2", "interleaved", torch.float64, "adamw", True, 1, 4, 2)
    _check(results)
    assert results[0]["boundaries"] == ("blocks.1", "blocks.2", "blocks.3")
    assert [(src, dst) for _, src, dst in results[0]["edges"]] == [(0, 1), (1, 2), (2, 3)]
    assert "blocks.2.ln1.weight" in results[0]["params"] and "blocks.1.ln1.weight" in results[1]["params"]


@pytest.mark.parametrize("schedule,modes", [("1f1b", ("full", "none")), ("1f1b", ("pointwise", "none")),
                                             ("1f1b", ("none", "alternate")),
                                             ("interleaved", ("full", "selective", "none", "full"))])
def test_a_recompute_mode_per_stage(pools, schedule, modes):
    v = len(modes) // 2
    results = pools(2).run(cases.gpt_parity, "pp=2", schedule, torch.float64, "adamw", True, 1, 4, v, 4, 5, 8, (),
                           modes)
    _check(results)
    regions = {c: names for r in results for c, names in r["recomputed"].items()}
    kind = {"none": "", "selective": "scaled_dot_product_attention", "pointwise": "blocks", "alternate": "blocks",
            "full": "blocks"}
    for c, mode in enumerate(modes):  # blocks (whole, or keeping their products), or only attention's core, or nothing
        assert bool(regions[c]) == (mode != "none") and all(kind[mode] in name for name in regions[c]), (c, regions)


def test_the_searched_recompute_mode_per_stage_trains_as_one_device(pools):
    # in 1.05 MiB the first stage, holding 2 micro-batches in flight, must recompute; the second need not
    results = pools(2).run(cases.searched_recompute_parity, 1075 * 1024)
    _check(results)
    first, second = results[0]["stage_recompute"]
    assert first in ("pointwise", "alternate", "full") and second == "none", results[0]["stage_recompute"]
    assert results[0]["recomputed"][0] and not results[1]["recomputed"][1]


def test_untied_head(pools):
    results = pools(2).run(cases.gpt_parity, "pp=2", "1f1b", torch.float64, "adamw", False)
    _check(results)
    assert results[0]["tied"] == [] and "wte.weight" not in results[1]["params"]


def test_gradient_accumulation(pools):
    _check(pools(2).run(cases.gpt_parity, "pp=2", "1f1b", torch.float64, "adamw", True, 2))


def test_boundaries_marked_by_pipeline_stage(pools):
    results = pools(2).run(cases.gpt_parity, "pp=2", "1f1b", torch.float64, "adamw", True, 1, 4, 1, 4, 5, 8,
                           ("blocks.3",))
    _check(results)
    assert results[0]["boundaries"] == ("blocks.3",)


def test_value_skipping_stages(pools):
    results = pools(4).run(cases.skip_parity, "pp=4")
    _check(results)
    assert ("blocks_0_1", 0, 3) in results[0]["edges"]  # the first block's output goes straight to the last stage


def test_value_between_chunks_of_one_stage(pools):
    results = pools(2).run(cases.skip_parity, "pp=2", "interleaved", 1, 2)
    _check(results)
    assert ("blocks_1_1", 1, 3) in results[0]["edges"]  # chunks 1 and 3 both run on stage 1: passed in memory


def test_1f1b_bounds_first_stage_activations(pools):
    m = 8
    first, last = pools(2).run(cases.saved_activation_peaks, m)
    one = first["one_micro_batch"]
    assert first["gpipe"] == m * one  # GPipe: every micro-batch's activations at once
    assert first["1f1b"] == 2 * one  # 1F1B: pp=2 micro-batches at most
    assert last["1f1b"] < last["gpipe"]


def test_recorded_timings_follow_the_schedule(pools):
    r = pools(2).run(cases.recorded_timings, "1f1b", 4)[0]
    measured, predicted = r["measured"], r["predicted"]
    assert sorted((t.stage, t.chunk, t.kind, t.micro) for t in measured) == \
        sorted((t.stage, t.chunk, t.kind, t.micro) for t in predicted)
    stage0 = [f"{t.chunk}{t.kind}{t.micro}" for t in measured if t.stage == 0]
    assert stage0 == [str(a) for a in r["actions"]]
    assert all(0 <= t.start_s <= t.end_s for t in measured)
    for stage in (0, 1):  # one action at a time per stage (clocks of two processes are not compared)
        own = [t for t in measured if t.stage == stage]
        assert all(a.end_s <= b.start_s for a, b in zip(own, own[1:]))
