"""`polyshard plan`, `cost` and `explain` in one process: JSON for scripts, fixed settings, round trips."""

import json
import re

import pytest

from polyshard import models
from polyshard.cli.main import main
from polyshard.cluster import DEVICE_TYPES
from polyshard.errors import PolyshardError
from polyshard.plan import Plan, chunk_values, chunks_text
from polyshard.planner.report import chosen_row

SHAPE = "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1024"


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_has_the_figures_scripts_compare(capsys):
    code, out, err = _run(capsys, "plan", "--model", SHAPE, "--cluster", "2x8xA100-80G", "--global-batch", "64",
                          "--json")
    assert code == 0 and err == ""  # no progress where stderr is not a terminal
    result = json.loads(out)  # one JSON object and nothing else on stdout
    assert result["step_s"] > 0 and 0 < result["memory_bytes_per_device"] <= result["limit_bytes"]
    assert set(result["breakdown"]) == {"compute_s", "op_comm_s", "dp_comm_s", "p2p_s", "bubble_s",
                                          "skew_s"}
    config = dict(kv.split("=") for kv in result["config"].split(","))
    assert int(config["dp"]) * int(config["tp"]) * int(config["pp"]) == 16
    assert result["model_tflops_per_device"] > 0 and result["planning_s"] < 60


def test_plan_on_a_terminal_shows_its_progress_then_clears_it(capsys, monkeypatch):
    """On a terminal the model's capture, then the splits costed counting up, show on one line of stderr, cleared
    before the answer; in a pipe (as above) stderr stays empty."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = _run(capsys, "plan", "--model", SHAPE, "--cluster", "2x8xA100-80G", "--global-batch", "64")
    assert code == 0 and out.startswith("planned ")
    shown = [line.removeprefix("\033[K") for line in err.split("\r")]
    shown = [line for line in shown if line.startswith("planning: ")]
    assert shown[0] == f"planning: building and capturing {SHAPE}" and shown[1].startswith("planning: 0 of ")
    assert shown[-1].startswith("planning: ") and err.endswith("\r\033[K")
    assert "planning" not in out
    code, _, err = _run(capsys, "plan", "--model", SHAPE, "--cluster", "2x8xA100-80G", "--memory-limit", "1MiB",
                        "--memory-reserve", "0")
    assert code == 2 and "\r\033[Kpolyshard: error: the model does not fit" in err  # the error on a clean line


def test_cost_prices_the_given_configuration_and_says_what_it_chose(capsys):
    args = ("--model", SHAPE, "--cluster", "2x8xA100-80G", "--global-batch", "64")
    code, out, _ = _run(capsys, "cost", *args, "--config", "tp=8,pp=2,recompute=full", "--json")
    assert code == 0
    given = json.loads(out)
    config = dict(kv.split("=") for kv in given["config"].split(","))
    assert (config["tp"], config["pp"], config["dp"], config["recompute"], config["zero"]) == ("8", "2", "1", "full", "0")
    code, _, err = _run(capsys, "cost", *args, "--config", "tp=8,pp=2,zero=1")
    assert code == 2 and "optimizer levels above 0 need dp > 1" in err
    _, out, _ = _run(capsys, "plan", *args, "--json")
    assert json.loads(out)["step_s"] <= given["step_s"]  # the free search does no worse than any configuration
    code, out, _ = _run(capsys, "cost", *args, "--config", "tp=8,pp=2")
    assert code == 0 and "kept tp=8,pp=2; the search chose dp=1," in out


def test_cost_compare_shows_the_pick_beside_the_configuration_term_by_term(capsys):
    args = ("--model", SHAPE, "--cluster", "8xA100-80G", "--global-batch", "32", "--config", "tp=8,recompute=full")
    code, out, _ = _run(capsys, "cost", *args, "--compare", "--layouts", "3")
    assert code == 0
    listed = out.split("parameter layouts:\n")[1].splitlines()
    assert len(listed) > 4 and listed[3].startswith("... ") and "more (the plan file has all)" in listed[3]
    table = out.split("given dp=")[1]
    for term in ("step", "compute", "op comm", "dp comm", "p2p", "bubble", "memory"):
        assert f"\n  {term} " in table
    code, out, _ = _run(capsys, "cost", *args, "--compare", "--json")
    result = json.loads(out)
    assert result["pick"]["step_s"] <= result["step_s"] and "tp=8" in result["config"]


def test_explain_shows_a_plan_beside_another_term_by_term(capsys, tmp_path):
    args = ("--model", SHAPE, "--cluster", "8xA100-80G", "--global-batch", "32")
    pick, mine, other = (tmp_path / f"{name}.json" for name in ("pick", "mine", "other"))
    assert _run(capsys, "plan", *args, "--out", str(pick))[0] == 0
    assert _run(capsys, "cost", *args, "--config", "tp=8,recompute=full", "--out", str(mine))[0] == 0
    code, out, _ = _run(capsys, "explain", str(pick), "--beside", str(mine), "--layouts", "0")
    assert code == 0
    table = out.split("\nmine dp=1,tp=8,")[1]
    for term in ("step", "compute", "op comm", "dp comm", "p2p", "bubble", "memory"):
        assert f"\n  {term} " in table
    steps = [json.loads(_run(capsys, "cost", *args, "--config", config, "--json")[1])["step_s"]
             for config in ("tp=8,recompute=full", Plan.from_json(pick.read_text()).report["config"])]
    step_row = next(line for line in table.splitlines() if line.startswith("  step "))
    assert all(f"{s * 1e3:.1f}ms" in step_row for s in steps)  # each plan's own predicted step
    assert f"pick's steps are {steps[0] / steps[1]:.2f}x as fast as mine's" in table
    assert _run(capsys, "cost", "--model", SHAPE, "--cluster", "4xA100-80G", "--global-batch", "32",
                "--config", "tp=4", "--out", str(other))[0] == 0
    code, _, err = _run(capsys, "explain", str(pick), "--beside", str(other))
    assert code == 2 and "differs from the plan in devices 4 against 8" in err
    assert _run(capsys, "cost", *args, "--seq-len", "32", "--config", "tp=8", "--out", str(other))[0] == 0
    code, _, err = _run(capsys, "explain", str(pick), "--beside", str(other))
    assert code == 2 and "differs from the plan in model" in err and "tokens a row 32 against 128" in err


@pytest.mark.parametrize("args,needle", [
    (("--config", "tp=3"), "tp=3"),
    (("--config", "pipes=2"), "unknown"),
    (("--model", "gpt:layers=2"), "needs hidden"),
    (("--global-batch", "-4"), "at least 1"),
    (("--workers", "0"), "--workers must be at least 1"),
    (("--candidates", "-2"), "--candidates must be 0 or more"),
    (("--image-size", "64"), "reads tokens"),
    (("--model", "unet-small", "--seq-len", "64"), "--seq-len is for token models"),
    (("--model", "unet-small", "--image-size", "30"), "use a multiple of 4"),
    (("--model", "unet-small", "--config", "tp=2"), "over dp, h and w only"),
    (("--config", "h=2"), "h and w split images"),
    (("--config", "tp=8,tp_comm=gather"), "tp_comm must be one of"),
    (("--config", "tp=8,sp=1,tp_comm=all_reduce"), "allows all-reduces alone"),
    (("--tp-plan", ""), "carries no tensor-parallel plan of its own"),
    (("--model", "unet-small", "--tp-plan", ""), "--tp-plan is for token models"),
])
def test_bad_planning_input_is_one_clear_error(capsys, args, needle):
    base = {"--model": SHAPE, "--cluster": "8xA100-80G", "--global-batch": "16"}
    base.update(dict(zip(args[::2], args[1::2])))
    code, _, err = _run(capsys, "cost" if "--config" in base else "plan",
                        *[x for kv in base.items() for x in kv if x])
    assert code == 2 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("device", DEVICE_TYPES)
@pytest.mark.parametrize("name", list(models.CONFIGS))
def test_plan_file_round_trips_through_explain(capsys, tmp_path, name, device):
    # every preset model on every preset device type, the large ones on clusters where some splits do not fit (or
    # none: refused); the plan file is written and read back
    path = tmp_path / "p.json"
    cluster = ("4x8x" if models.CONFIGS[name].num_params() > 5e9 else "8x") + device
    code, out, err = _run(capsys, "plan", "--model", name, "--cluster", cluster, "--out", str(path))
    if code == 2:
        assert "does not fit" in err  # too large for this cluster: said so, nothing written
        assert not path.exists()
        return
    assert code == 0 and path.is_file()
    plan = Plan.from_json(path.read_text())
    assert plan.model == name and plan.report["config"]
    large = models.CONFIGS[name].num_params() > 5e9
    assert not large or any(not c["fits"] for c in plan.report["candidates"] if not c.get("pruned"))
    code, shown, _ = _run(capsys, "explain", str(path))
    assert code == 0 and chosen_row(plan.report)["brief"] in shown


def test_explain_timeline_matches_the_plans_step(capsys, tmp_path):
    path, png = tmp_path / "p.json", tmp_path / "t.png"
    code, _, _ = _run(capsys, "cost", "--model", SHAPE, "--cluster", "8xA100-80G", "--global-batch", "32",
                      "--config", "pp=4,m=8,schedule=1f1b", "--out", str(path))
    assert code == 0
    plan = Plan.from_json(path.read_text())
    chosen = chosen_row(plan.report)
    code, out, _ = _run(capsys, "explain", str(path), "--timeline", str(png))
    assert code == 0 and png.stat().st_size > 1000
    drawn_ms = float(out.split("timeline: ")[1].split(": schedule ")[1].split(" ms")[0])
    assert drawn_ms == pytest.approx(chosen["pipeline"]["span_s"] * 1e3, rel=1e-3)
    assert f"step {chosen['step_s'] * 1e3:.4g} ms" in out


def test_plan_takes_a_transformers_config(capsys, tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
                                  "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
                                  "num_key_value_heads": 2, "max_position_embeddings": 128}))
    code, out, _ = _run(capsys, "plan", "--model", f"hf:{config}", "--cluster", "2x8xA100-80G",
                        "--global-batch", "64", "--json")
    assert code == 0
    result = json.loads(out)
    config_kv = dict(kv.split("=") for kv in result["config"].split(","))
    assert int(config_kv["dp"]) * int(config_kv["tp"]) * int(config_kv["pp"]) == 16
    assert result["step_s"] > 0 and result["model_tflops_per_device"] > 0
    at_64 = ("cost", "--model", f"hf:{config}", "--cluster", "1xH100-80G", "--global-batch", "4", "--seq-len", "64",
             "--config", "dp=1,precision=bf16")
    code, out, _ = _run(capsys, *at_64, "--json")
    assert code == 0 and json.loads(out)["step_s"] > 0
    # the plan file records the length it was made for, which a run of it trains at
    code, out, _ = _run(capsys, *at_64, "--out", str(tmp_path / "p.json"))
    assert code == 0 and f"`polyshard train --plan {tmp_path / 'p.json'}`" in out
    written = Plan.from_json((tmp_path / "p.json").read_text())
    assert (written.model, written.global_batch, written.seq_len) == (f"hf:{config}", 4, 64)
    _trains_at_what_it_was_made_for(str(tmp_path / "p.json"), 1, {"batch_size": 4, "seq_len": 64},
                                    {"seq_len": 32, "batch_size": 8})


def test_plan_pins_a_transformers_models_own_tp_plan(capsys):
    """`plan --tp-plan`: Llama's projections split as its own plan names them, on the fastest split that holds the
    pins (every one with tp > 1 is costed), which the report says the plan follows."""
    pytest.importorskip("transformers")
    code, out, _ = _run(capsys, "plan", "--model", "hf:llama", "--cluster", "8xA100-80G", "--global-batch", "64",
                        "--tp-plan", "--layouts", "0", "--candidates", "100")
    assert code == 0 and "followed by 16 of 16 modules" in out, out
    listed = {int(m) for m in re.findall(r"x tp=(\d+)", out)}
    assert listed == {2, 4, 8}, out


def test_plan_of_an_image_model_weighs_height_and_width_splits(capsys, tmp_path):
    """An image model is planned over dp x h x w splits and its plan is spelled in them (no tp)."""
    args = ("--model", "unet-small", "--image-size", "1024", "--cluster", "1x4xA100-80G", "--global-batch", "4")
    code, out, _ = _run(capsys, "plan", *args, "--memory-limit", "6GiB", "--memory-reserve", "0", "--json")
    assert code == 0
    result = json.loads(out)
    config = dict(kv.split("=") for kv in result["config"].split(","))
    assert "tp" not in config and int(config["dp"]) * int(config["h"]) * int(config["w"]) == 4, config
    assert result["images_per_s"] == pytest.approx(4 / result["step_s"])
    path = tmp_path / "p.json"
    code, out, _ = _run(capsys, "cost", *args, "--config", "dp=1,h=2,w=2", "--out", str(path))
    assert code == 0 and "kept dp=1,h=2,w=2" in out and "1024 x 1024 images" in out
    plan = Plan.from_json(path.read_text())
    assert plan.model == "unet-small" and dict(plan.mesh) == {"dp": 1, "h": 2, "w": 2}
    assert (plan.image_size, plan.seq_len, plan.global_batch) == (1024, 0, 4)
    _trains_at_what_it_was_made_for(str(path), 4, {"batch_size": 4, "image_size": 1024},
                                    {"image_size": 512, "batch_size": 12})


def _trains_at_what_it_was_made_for(path: str, world: int, made_for: dict, others: dict) -> None:
    """`train --plan` takes the plan file's batch and row size where its flags leave them out, refuses others, and
    takes a batch the plan's times --accum."""
    from polyshard.train.config import check_config
    from polyshard.train.options import TrainConfig

    cfg, _, _ = check_config(TrainConfig(plan=path), world)
    assert {k: getattr(cfg, k) for k in made_for} == made_for
    for name, value in others.items():
        flag = "--" + name.replace("_", "-")
        with pytest.raises(PolyshardError, match=f"made for .* not {flag} {value}: leave out {flag}, or plan again"):
            check_config(TrainConfig(plan=path, **{name: value}), world)
    accumulated, _, _ = check_config(TrainConfig(plan=path, batch_size=2 * made_for["batch_size"], accum=2), world)
    assert accumulated.batch_size == 2 * made_for["batch_size"]


def test_a_cluster_whose_ranks_arrive_apart_shows_the_wait_as_a_term(capsys, tmp_path):
    import dataclasses

    from polyshard.cluster import Cluster

    path = tmp_path / "skewed.yaml"
    dataclasses.replace(Cluster.preset("cpu-gloo:4"), arrival_skew=0.25).to_yaml(path)
    args = ("cost", "--model", "gpt-tiny", "--cluster", str(path), "--global-batch", "16", "--config", "dp=4,zero=0")
    code, out, _ = _run(capsys, *args, "--json")
    terms = json.loads(out)["breakdown"]
    assert code == 0 and terms["skew_s"] == pytest.approx(0.25 * terms["compute_s"]) and terms["skew_s"] > 0
    code, out, _ = _run(capsys, *args)
    header = next(line for line in out.splitlines() if line.lstrip().startswith("mesh"))
    assert code == 0 and header.split()[-3:] == ["wait", "memory", "gap"]
    assert f"the step waits {terms['skew_s'] * 1e3:.1f}ms for ranks" in out


def test_the_plan_says_which_layers_run_whole_because_their_sizes_do_not_divide(capsys, tmp_path):
    """With 252 features and 1001 token rows neither dim of the table, the head or the attention's products divides
    by 8 ranks: they run whole on each, and the plan names them (with 256 and 1024 they may split: nothing said)."""
    args = ("--cluster", "1x8xA100-80G", "--global-batch", "8", "--config", "tp=8")
    out_file = tmp_path / "odd.json"
    odd = "gpt:layers=2,hidden=252,heads=6,seq=128,vocab=1001"
    code, out, _ = _run(capsys, "cost", "--model", odd, *args, "--out", str(out_file))
    assert code == 0
    plan = Plan.from_json(out_file.read_text())
    whole = {path: tuple(shape) for path, shape in plan.report["left_whole"]}
    assert whole["wte"] == whole["lm_head"] == (1001, 252)
    attention = {f"blocks.{b}.attn.{p}" for b in (0, 1) for p in ("q", "k", "v", "proj")}
    assert set(whole) == {"wte", "lm_head"} | attention  # the MLP's 1008 features divide: not listed
    assert all(plan.params[f"{path}.weight"].is_replicated for path in set(whole) - {"lm_head"})  # tied: wte.weight
    assert "wte (1001 x 252), blocks.0.attn.q (252 x 252)" in out and "and 6 more run whole on each of the 8" in out
    code, out, _ = _run(capsys, "cost", "--model", SHAPE, *args)
    assert code == 0 and "run whole" not in out


def test_a_stage_split_of_tp_ranks_is_priced_spelled_and_explained(capsys, tmp_path):
    """`tp_split` fixes what each pipeline chunk's tp ranks split; the output spells it back, pricing that spelling
    gives the same step, and `explain` shows each stage's split."""
    args = ("--model", SHAPE, "--cluster", "8xA100-80G", "--global-batch", "64")
    out_file = tmp_path / "rows.json"
    code, out, _ = _run(capsys, "cost", *args, "--config", "tp=4,pp=2,tp_split=rows", "--json", "--out", str(out_file))
    assert code == 0
    given = json.loads(out)
    split = dict(kv.split("=") for kv in given["config"].split(","))["tp_split"]
    each = chunk_values(split, "tp_split")  # a run of chunks spelled once: rows*2
    assert set(each) == {"rows"} and len(each) % 2 == 0 and split == chunks_text(each)
    again = json.loads(_run(capsys, "cost", *args, "--config", given["config"], "--json")[1])
    assert again["step_s"] == pytest.approx(given["step_s"])
    plan = Plan.from_json(out_file.read_text())
    assert plan.stage_tp_split == each and plan.params["blocks.1.mlp.fc.weight"].is_replicated
    code, out, _ = _run(capsys, "explain", str(out_file), "--layouts", "0")
    chunks = len(each)
    assert code == 0 and f"tp splits rows on {chunks} of {chunks} chunks" in out and out.count("  rows\n") == chunks
    code, _, err = _run(capsys, "cost", *args, "--config", "tp=4,pp=2,tp_split=cols")
    assert code == 2 and "tp_split must be one of" in err


def test_the_table_counts_settings_per_chunk_and_the_plan_keeps_each(capsys, tmp_path):
    """A recompute mode per pipeline chunk is counted in the table's row (a 128-chunk list would fill the line) and
    spelled out in the plan's configuration, a run of chunks as MODE*COUNT."""
    out_file = tmp_path / "p.json"
    code, out, _ = _run(capsys, "cost", "--model", SHAPE, "--cluster", "8xA100-80G", "--global-batch", "64",
                        "--config", "tp=2,pp=2,v=2,schedule=interleaved,recompute=none/full/full/pointwise",
                        "--out", str(out_file))
    assert code == 0 and "recompute full on 2 and pointwise on 1 of 4 chunks" in out and "recompute none/" not in out
    plan = Plan.from_json(out_file.read_text())
    assert plan.stage_recompute == ("none", "full", "full", "pointwise") and "recompute=none/full*2/pointwise" in \
        plan.report["config"]


def test_the_table_lists_the_fastest_candidates_and_the_choice_wherever_it_ranks(capsys, tmp_path):
    path = tmp_path / "p.json"
    assert _run(capsys, "plan", "--model", SHAPE, "--cluster", "2x8xA100-80G", "--global-batch", "64",
                "--candidates", "3", "--out", str(path))[0] == 0
    report = Plan.from_json(path.read_text()).report
    everyone = len(report["candidates"])
    assert everyone > 20
    rows = ("* ", "  ", "x ")  # chosen, fitting or pruned, not fitting

    def listed(shown: str) -> list[str]:
        table = shown.split("\n  mesh ", 1)[1].splitlines()[1:]
        return [line for line in table if line.startswith(rows) and not line.startswith("  ...")][:everyone + 1]

    code, shown, _ = _run(capsys, "explain", str(path), "--candidates", "0", "--layouts", "0")
    assert code == 0 and f"... {everyone - 1} more (--candidates {everyone} lists every one)" in shown
    assert listed(shown)[0].startswith("* " + chosen_row(report)["brief"])
    code, shown, _ = _run(capsys, "explain", str(path), "--candidates", str(everyone), "--layouts", "0")
    assert code == 0 and "more (--candidates" not in shown
    assert [line[2:].split()[0] for line in listed(shown)[:everyone]] == \
        [c["brief"].split()[0] for c in report["candidates"]]
