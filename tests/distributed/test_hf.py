"""transformers models as written (tiny configs, random init) on 2-4 gloo ranks vs one device."""

import pytest

pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")

from tests.distributed import hf_cases  # noqa: E402

TOL = 1e-5


def _check(results):
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL and not r["missing"], r


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mesh", ["dp=4", "tp=4", "dp=2,tp=2"])
def test_hf_data_and_tensor_parallel(pools, family, mesh):
    _check(pools(4).run(hf_cases.hf_parity, mesh, family))
