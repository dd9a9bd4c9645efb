"""Capture and sharding propagation on meta models, in one process."""

import json
import warnings

import pytest
import torch

import polyshard as ps
from polyshard import models
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.layout import Layout
from polyshard.plan import Plan
from polyshard.planner.propagate import propagate


def _plan(model, mesh, inputs=None):
    seen = []
    gm = capture(model, inputs if inputs is not None else model.example_inputs())
    return propagate(gm, mesh, seen.append), seen


def test_gpt_gets_megatron_layouts_on_meta():
    plan, warned = _plan(models.build("gpt-tiny", "meta"), (("tp", 4),))
    p = {k: str(v) for k, v in plan.params.items()}
    assert p["wte.weight"] == "S(0)" and "lm_head.weight" not in p  # tied: one entry
    assert p["blocks.1.attn.v.weight"] == "S(0)" and p["blocks.1.attn.v.bias"] == "S(0)"
    assert p["blocks.1.attn.proj.weight"] == "S(1)" and p["blocks.1.attn.proj.bias"] == "R"
    assert p["wpe.weight"] == "R" and p["ln_f.weight"] == "R"
    assert plan.nodes["cross_entropy"].impl == "vocab_ce"
    assert plan.nodes["scaled_dot_product_attention"].output.dims[1] == ("tp",)  # heads split
    assert not warned


def test_large_configs_capture_on_meta():
    plan, _ = _plan(models.build("pangu-alpha-2.6b", "meta"), (("tp", 8),), None)
    assert str(plan.params["blocks.31.mlp.fc.weight"]) == "S(0)"


def test_untied_head_is_column_parallel():
    import dataclasses
    model = models.GPT(dataclasses.replace(models.CONFIGS["gpt-tiny"], tied=False)).to("meta")
    plan, _ = _plan(model, (("tp", 2),))
    assert str(plan.params["lm_head.weight"]) == "S(0)"


def test_pin_overrides_the_default():
    model = models.MLPClassifier(16, 32, 8)
    ps.shard(model.fc1, in_strategy=((1, 2), (1, 2)))  # row-parallel: input features split
    plan, _ = _plan(model, (("tp", 2),))
    assert str(plan.params["fc1.weight"]) == "RS(1)" or plan.params["fc1.weight"].dims == ((), ("tp",))
    assert plan.nodes["fc1"].inputs["flatten"].dims == ((), ("tp",))


def test_pin_that_does_not_divide_names_the_module():
    model = models.MLPClassifier(16, 32, 8)
    ps.shard(model.fc2, in_strategy=((1, 1), (3, 1)))
    with pytest.raises(PolyshardError, match="fc2.*does not divide dim 0 of size 8"):
        _plan(model, (("tp", 2),))


def test_mlp_default_is_column_then_row():
    plan, _ = _plan(models.MLPClassifier(16, 32, 8), (("tp", 2),))
    assert plan.params["fc1.weight"].dims == (("tp",), ())
    assert plan.params["fc2.weight"].dims == ((), ("tp",))


def test_op_without_rule_warns_and_replicates():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 8)

        def forward(self, x):
            return torch.cumsum(self.fc(x), 1).sum()

    plan, warned = _plan(Net(), (("tp", 2),), (torch.zeros(2, 4),))
    assert warned == ["no sharding rule for `cumsum` (call_function); it runs replicated"]
    assert plan.nodes["cumsum"].inputs["fc"].is_replicated


class _Repeats(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)

    def forward(self, x):
        h = self.fc(x)  # (rows, 3, 8), its features split
        return (h.repeat_interleave(2, dim=1) + h.repeat(1, 2, 1)).sum()


@pytest.mark.parametrize("exported", [False, True])
def test_repeats_keep_the_dims_they_copy_once_split(exported):
    """repeat_interleave along the sequence and repeat tiling it: the features a column-parallel product split stay
    split through both (traced as methods, or exported as aten ops), where both used to run whole."""
    x = torch.zeros(2, 3, 4)
    plan, warned = _plan(_Repeats(), (("tp", 2),), {"x": x} if exported else (x,))
    assert warned == []
    for name in ("repeat_interleave", "repeat"):
        assert plan.nodes[name].output.dims == ((), (), ("tp",)), plan.nodes[name]


class _Gathers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)

    def forward(self, x, index):
        return torch.gather(self.fc(x), 1, index).sum()  # per feature, positions picked from the sequence


@pytest.mark.parametrize("exported", [False, True])
@pytest.mark.parametrize("width,split", [(8, True), (4, False)])
def test_a_gather_keeps_the_dims_its_index_spans_whole_split(exported, width, split):
    """gather along the sequence: the features a column-parallel product split stay split where the index spans them
    all (each rank picks its own features), and are gathered where it spans only some."""
    x, index = torch.zeros(2, 3, 4), torch.zeros(2, 5, width, dtype=torch.long)
    plan, warned = _plan(_Gathers(), (("tp", 2),), {"x": x, "index": index} if exported else (x, index))
    assert warned == []
    node = plan.nodes["gather"]
    assert node.output.dims == ((), (), ("tp",) if split else ()), node
    assert all(layout == node.output for layout in node.inputs.values()), node


class _Lookups(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(10, 4))
        self.register_buffer("fixed", torch.zeros(10, 4))

    def forward(self, ids):
        return torch.nn.functional.embedding(ids, self.fixed) + torch.nn.functional.embedding(ids, self.table)


def test_a_lookup_called_as_a_function_keeps_its_ids_split_unless_the_table_trains():
    """Ids split over the rows: a fixed table looks its rows' ids up on each rank; a trained one runs whole, as each
    rank's gradient of the whole table from its own ids would be only its part of the sum."""
    gm = capture(_Lookups(), (torch.zeros(4, 3, dtype=torch.long),))
    rows = Layout.replicated((("tp", 2),), 2).with_dims([("tp",), ()])
    warned = []
    plan = propagate(gm, (("tp", 2),), warned.append, inputs={"ids": rows})
    fixed, trained = (plan.nodes[n.name] for n in gm.graph.nodes if n.target is torch.nn.functional.embedding)
    assert warned == []
    assert fixed.inputs["ids"] == rows and fixed.output.dims == (("tp",), (), ())
    assert trained.inputs["ids"].is_replicated and trained.output.is_replicated


def test_plan_round_trips_through_json():
    plan, _ = _plan(models.build("gpt-tiny", "meta"), (("tp", 2),))
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again.to_json() == text and again.params == plan.params


def test_plan_from_bad_json_is_a_clear_error():
    with pytest.raises(PolyshardError, match="not a polyshard plan"):
        Plan.from_json('{"params": {}}')


def test_parallelize_needs_shapes_for_foreign_models():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps.init()
    with pytest.raises(PolyshardError, match="example_inputs"):
        ps.parallelize(torch.nn.Linear(2, 2))


def test_conflicting_pins_on_a_shared_weight_name_both_modules():
    model = models.build("gpt-tiny")
    ps.shard(model.wte, in_strategy=((1, 1), (2, 1)))      # vocabulary split
    ps.shard(model.lm_head, in_strategy=((1, 1, 2), (1, 2)))  # hidden split: the same weight, another way
    with pytest.raises(PolyshardError, match="conflicting pins: `wte` .* but `lm_head` needs"):
        _plan(model, (("tp", 2),))


def test_a_flatten_after_a_split_dim_keeps_its_dim_arguments(tmp_path):
    """Rotary embeddings that rotate interleaved pairs (Cohere's, GLM's, Helium's) stack the halves and flatten the
    last two dims, on values whose heads are split: flatten's arguments are dims, not sizes to divide."""
    pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")
    config = tmp_path / "cohere.json"
    config.write_text(json.dumps(dict(model_type="cohere", vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)))
    model = models.build(f"hf:{config}", device="meta")
    plan, _ = _plan(model, (("tp", 2),))
    flattens = [name for name in plan.nodes if name.startswith("flatten")]
    assert flattens and any(plan.nodes[name].output.dims[1] for name in flattens)  # heads split through them
    assert all(plan.nodes[name].shape_divisors == {} for name in flattens)
