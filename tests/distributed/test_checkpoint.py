"""Checkpoints move between plans: saved under one, resumed under another, the steps after equal the
uninterrupted run's (float64, 1e-5); under the same plan, bit for bit (here under fp16, and in
test_checkpoint_cli.py through kills and restarts)."""

import functools

import pytest

from tests.distributed import checkpoint_cases

TOL = 1e-5
# bf16 keeps 8 bits of mantissa: a run that continues in full precision computes from weights the bf16 run
# rounded to it, and departs from that run by up to about that much in its losses; its parameters are not
# compared, since AdamW turns the bf16 rounding of near-zero gradients into full-size updates of its own sign
BF16_TOL = 1e-2

CASES = {
    "fp16 over fp32 masters, bit for bit": ({"mesh": "dp=4", "settings": {"precision": "fp16", "zero": 1}},
                                                 {"mesh": "dp=4", "settings": {"precision": "fp16", "zero": 1}}, 0.0),
    "tp pieces into pipeline stages": ({"mesh": "dp=2,tp=2"}, {"mesh": "dp=2,pp=2"}, TOL),
    "ZeRO-1 shards into ZeRO-3 over tp": ({"mesh": "dp=4", "settings": {"zero": 1}},
                                          {"mesh": "dp=2,tp=2", "settings": {"zero": 3}}, TOL),
    "pipeline with ZeRO-2 into one replica per rank": ({"mesh": "dp=2,pp=2", "settings": {"zero": 2}},
                                                       {"mesh": "dp=4"}, TOL),
    "disk-offloaded state into tp": ({"mesh": "dp=4", "settings": {"offload": "disk"}}, {"mesh": "tp=4"}, TOL),
    "bf16 masters into full precision": ({"mesh": "dp=4", "settings": {"precision": "bf16", "zero": 1}},
                                         {"mesh": "dp=2,tp=2"}, BF16_TOL),
    "LAMB's integer steps through ZeRO": ({"mesh": "dp=4", "settings": {"optimizer": "lamb", "zero": 1}},
                                         {"mesh": "dp=2,tp=2", "settings": {"optimizer": "lamb"}}, TOL),
}


@pytest.mark.parametrize("case", CASES)
def test_resume_under_another_plan_continues_the_run(pools, tmp_path, case):
    first, second, tol = CASES[case]
    results = pools(4).run(functools.partial(checkpoint_cases.resume_elsewhere, str(tmp_path), first, second))
    r = results[0]
    assert len(r["resumed"]) == len(r["whole"]) == 3
    if tol == 0.0:
        assert r["resumed"] == r["whole"] and r["param_gap"] == 0.0, r
    else:
        assert r["resumed"] == pytest.approx(r["whole"], rel=tol), r
        assert tol == BF16_TOL or r["param_gap"] < tol, r
