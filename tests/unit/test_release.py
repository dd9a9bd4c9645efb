"""A parallel module and its optimizer are freed once the user drops them, as a plain torch model is: the
gradient hooks on the parameters must not keep the buckets, and so the whole model, alive."""

import gc
import tempfile
import weakref

import pytest

import polyshard as ps
from polyshard import models
from polyshard.train.trainer import make_optimizer, train_step


@pytest.mark.parametrize("settings", [{}, {"precision": "bf16"}, {"optimizer": "lamb"}])
def test_a_trained_module_is_freed_when_dropped(settings):
    ps.init()
    model = models.build("gpt-tiny")
    x, y = model.example_inputs(4)
    pm = ps.parallelize(model, (x, y), settings=settings)
    with tempfile.TemporaryDirectory() as scratch:
        opt = make_optimizer(pm, 1e-3, scratch)
        train_step(pm, opt, x, y)
    kept = [weakref.ref(p) for p in pm.parameters()] + [weakref.ref(pm), weakref.ref(opt)]
    del model, pm, opt
    gc.collect()
    assert not any(r() is not None for r in kept)
