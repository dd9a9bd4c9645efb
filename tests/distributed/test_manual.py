"""Manual tier: collectives over named axes and point-to-point sends, with gradients."""

from tests.distributed import cases


def test_collectives_over_named_axes(pools):
    results = pools(4).run(cases.manual_collectives)
    assert all(r["err"] < 1e-12 for r in results), results
    assert all(r["reused"] and r["names"] == [("tp",), ("tp",), ("dp",)] for r in results), results


def test_send_recv_carry_gradients_back(pools):
    results = pools(2).run(cases.manual_pipeline)
    assert all(r["grad_err"] < 1e-12 for r in results), results
    assert results[1]["loss_err"] < 1e-12
