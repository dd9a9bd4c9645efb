"""A table split unevenly by rows (manual_split) trains as one device does, issues the one all-reduce an even
split's lookup does, and its checkpoints load under another split."""

import functools

import pytest

from tests.distributed import rows_cases as cases

TOL = 1e-10


@pytest.mark.parametrize("mesh,rows", [("tp=4", (10, 20, 30, 4)), ("dp=2,tp=2", (40, 24))])
def test_uneven_rows_train_as_one_device(pools, mesh, rows):
    results = pools(4).run(cases.click_parity, mesh, rows, len(rows))
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL, r
        assert r["row_splits"] == {"table.weight": rows}
    assert sorted(r["table"][0] for r in results) == sorted(rows * (4 // len(rows)))  # each rank its own rows


def test_the_lookup_issues_one_all_reduce_as_an_even_split_does(pools):
    uneven, even, whole = (pools(4).run(cases.click_parity, "tp=4", rows, pieces)[0]
                           for rows, pieces in (((10, 20, 30, 4), 4), (None, 4), (None, 1)))
    assert even["table"] == (16, 8) and whole["table"] == (64, 8) and not even["row_splits"]
    assert even["loss_err"] < TOL and even["param_err"] < TOL
    assert uneven["ops"] == even["ops"]
    # against a whole table: one all-reduce more in forward (the pieces' lookups summed), none in backward
    assert uneven["ops"]["forward"] == whole["ops"]["forward"] + ["all_reduce"]
    assert uneven["ops"]["backward"] == whole["ops"]["backward"]


@pytest.mark.parametrize("loaded,pieces", [((4, 30, 20, 10), 4), (None, 4)])
def test_a_checkpoint_loads_under_another_split(pools, tmp_path, loaded, pieces):
    """Saved with rows (10, 20, 30, 4), loaded with other uneven rows or an even split: the same weights and
    optimizer state, so the next step matches the run that never stopped."""
    results = pools(4).run(cases.checkpoint_across_splits, str(tmp_path), (10, 20, 30, 4), loaded, pieces)
    for r in results:
        assert r["loaded_gap"] == 0 and r["loss_gap"] < TOL and r["param_gap"] < TOL, r
    assert sorted(r["table"][0] for r in results) == sorted(loaded or (16,) * 4)


@pytest.mark.parametrize("search", [False, True])
def test_llamas_token_table_split_unevenly(pools, search):
    """A transformers Llama, unmodified, its input embedding's 256 rows split (100, 60, 60, 36) over tp=4: the
    rules and the search plan the rest, and it trains as one device does."""
    pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")
    from tests.distributed import hf_cases

    results = pools(4).run(functools.partial(hf_cases.hf_parity, table_rows=(100, 60, 60, 36), search=search),
                           "tp=4", "llama")
    for r in results:
        assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5 and not r["missing"], r
    assert results[0]["layouts"]["model.embed_tokens.weight"] == "S(0)"


def test_gemmas_scaled_table_split_unevenly(pools):
    """Gemma's embedding scales what it looks up, in a forward of its own: each piece of its table, split
    (100, 60, 60, 36) over tp=4, runs that forward on the ids it holds (its head untied, as a split table
    must be)."""
    pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")
    from tests.distributed import hf_cases

    results = pools(4).run(functools.partial(hf_cases.hf_parity, table_rows=(100, 60, 60, 36), optimizer="sgd",
                                             config={"tie_word_embeddings": False}), "tp=4", "gemma")
    for r in results:
        assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5 and not r["missing"], r
    assert results[0]["layouts"]["model.embed_tokens.weight"] == "S(0)"
