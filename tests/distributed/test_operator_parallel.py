"""Semi-auto operator parallel: pinned matmuls on 2 and 4 ranks equal plain matmuls."""

import functools

import pytest

from tests.distributed import cases

TOL = 1e-5
MATMULS = {
    "rows_of_A": ((2, 1), (1, 1)),
    "columns_of_B": ((1, 1), (1, 2)),
    "contraction": ((1, 2), (2, 1)),
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", MATMULS)
def test_matmul_strategy_matches_one_device(pools, world, case):
    results = pools(world).run(cases.matmul_parity, MATMULS[case])
    assert all(r["err"] < TOL for r in results), results
    if case == "contraction":
        assert "Partial" in results[0]["layout"]  # partial sums, reduced only when the full tensor is read


@pytest.mark.parametrize("world", [2, 4])
def test_two_matmuls_get_a_redistribution_between_them(pools, world):
    results = pools(world).run(cases.two_matmul_parity)
    assert all(r["err"] < TOL for r in results), results
    assert results[0]["forward_collectives"] == ["all_gather"]  # rows gathered once, V's columns sliced locally
    assert "Shard(dim=1)" in results[0]["out"]


def test_out_strategy_reduce_scatters_partial_sums(pools):
    results = pools(4).run(cases.matmul_parity, ((1, 2), (2, 1)), (2, 1))
    assert all(r["err"] < TOL for r in results), results
    assert "Shard(dim=0)" in results[0]["layout"]


TRANSITIONS = [
    # (src dims, dst dims, src partial, dst partial)
    ([["a", "b"], []], [[], ["b"]], [], []),   # all-to-all on b, then all-gather on a
    ([[], []], [["b"], []], ["a"], []),        # all-reduce on a, slice on b
    ([[], []], [["a"], []], ["a"], []),        # reduce-scatter on a
    ([["b"], []], [[], []], [], []),           # all-gather on b
    ([["a"], ["b"]], [["b"], ["a"]], [], []),  # every split moves
]


def test_a_mesh_without_all_to_all_gathers_and_slices(pools):
    """b's split moves from dim 0 to dim 1 and a's is gathered: with all-to-all allowed, b moves by one;
    without, b is gathered and sliced, and the values and the bytes the planner counts still match."""
    for allowed, steps in ((True, ["all_to_all", "all_gather"]), (False, ["all_gather", "all_gather", "slice"])):
        case = functools.partial(cases.redistribution_bytes, all_to_all=allowed)
        for r in pools(4).run(case, "a=2,b=2", [["a", "b"], []], [[], ["b"]], [], []):
            assert r["err"] < TOL and r["steps"] == steps
            assert {k: v for k, v in r["predicted"].items() if v} == r["measured"], r


def test_training_without_all_to_all_equals_one_device_and_issues_none(pools):
    """The hidden activations' split moves from rows to features: by all-to-all where the mesh allows one
    (forward, and its gradient's way back), by gathering and slicing where it does not; both train as one
    device does."""
    for allowed in (True, False):
        for r in pools(2).run(cases.all_to_all_parity, allowed):
            assert r["loss_err"] < TOL and r["param_err"] < TOL, r
            assert r["all_to_alls_per_step"] == (2 if allowed else 0), r
            assert "all_gather" in r["collectives"], r


@pytest.mark.parametrize("src,dst,src_p,dst_p", TRANSITIONS)
def test_redistribution_bytes_match_the_wire(pools, src, dst, src_p, dst_p):
    results = pools(4).run(cases.redistribution_bytes, "a=2,b=2", src, dst, src_p, dst_p)
    for r in results:
        assert r["err"] < TOL
        predicted = {k: v for k, v in r["predicted"].items() if v}
        assert predicted == r["measured"], r


def test_tensor_parallel_reduces_each_shared_input_gradient_once(pools):
    """Megatron's f operator: q, k and v take one input, whose gradient's partial sums are added
    before one all-reduce; so backward issues two all-reduces per layer (attention's input, the MLP's)
    and one for the vocabulary-split head's input, not one per split product (q, k, v: three)."""
    r = pools(4).run(cases.tensor_parallel_collectives)[0]
    assert r["backward"] == 2 * r["layers"] + 1, r



@pytest.mark.parametrize("model,sequence", [("gpt-tiny", 0), ("gpt-tiny", 1), ("hf:llama", 0), ("hf:llama", 1),
                                            ("hf:gpt2", 0)])  # (GPT-2's fused q, k and v keep it whole)
def test_the_cost_model_prices_the_bytes_each_pass_sends(pools, model, sequence):
    """What the planner prices for a searched tensor-parallel plan is what one training step's collectives send,
    forward and backward apart: a gradient comes back the reverse way of its value's move only where the op
    taking it computes whole (a gather's gradient is sliced; a product split by its outputs sends its input's
    partial sums back, once for every product taking it so), and a partial sum's reduction sends nothing back."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")
    r = pools(4).run(cases.planned_bytes, model, "tp=4", sequence)[0]
    assert r["split"] and r["sequence_parallel"] == bool(sequence), r
    for issued, predicted in (r["forward"], r["backward"]):
        assert issued == pytest.approx(predicted, rel=1e-9) and issued > 0, r
