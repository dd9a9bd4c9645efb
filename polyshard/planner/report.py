"""A plan as the table ``polyshard plan`` and ``polyshard explain`` print."""

from __future__ import annotations

import math

from polyshard.cluster import format_bytes
from polyshard.models.gpt import GPTConfig, flops_per_token
from polyshard.plan import Plan


def chosen_row(report: dict) -> dict | None:
    """The chosen candidate's row of a search report (None for a plan made without a search)."""
    return next((c for c in report.get("candidates", ()) if c["mesh"] == report.get("chosen")), None)


def _brief(row: dict) -> str:
    """A candidate's row named as a table shows it: settings per pipeline chunk counted (plans written before
    rows carried that name show the full one)."""
    return row.get("brief", row["mesh"])


def summary(plan: Plan, cfg: GPTConfig | None, num_devices: int) -> dict:
    """The chosen candidate's figures as plain JSON: predicted seconds per step and their parts,
    memory per device, the configuration in the ``--config`` spelling, and for a token model (``cfg``)
    model TFLOP/s per device (PaLM's 6N + 12 L H T FLOPs per token, N the parameters a token passes through:
    polyshard.models.flops_per_token),
    for an image model (``cfg`` None) images per second."""
    rep = plan.report
    chosen = chosen_row(rep)
    if cfg is None:
        rate = {"images_per_s": plan.global_batch / chosen["step_s"]}
    else:
        tokens = plan.global_batch * cfg.seq_len
        rate = {"tokens_per_s": tokens / chosen["step_s"],
                "model_tflops_per_device": flops_per_token(cfg) * tokens / chosen["step_s"] / num_devices / 1e12}
    return {"step_s": chosen["step_s"], "memory_bytes_per_device": chosen["memory"]["total"],
            "config": rep["config"], "mesh": chosen["mesh"],
            "breakdown": {k: chosen.get(k, 0.0) for k in ("compute_s", "op_comm_s", "dp_comm_s", "p2p_s", "bubble_s",
                                                          "skew_s")},
            "memory": chosen["memory"], "limit_bytes": rep["limit_bytes"], "reserve_bytes": rep.get("reserve_bytes", 0),
            **rate}


def compare(given: dict, pick: dict, names: tuple[str, str] = ("given", "pick")) -> str:
    """Two :func:`summary` figures side by side, term by term (by default a configuration and the search's
    pick)."""
    a, b = names
    rows = [("step", given["step_s"], pick["step_s"])] + \
        [(k.removesuffix("_s").replace("_", " "), given["breakdown"][k], pick["breakdown"][k]) for k in given["breakdown"]]
    width = max(map(len, names))
    lines = [f"{a:<{width}} {given['config']}", f"{b:<{width}} {pick['config']}",
             f"  {'term':<10} {a:>12} {b:>12} {f'{b} - {a}':>13}"]
    lines += [f"  {name:<10} {_ms(x)} {_ms(y)} {(y - x) * 1e3:>+11.1f}ms" for name, x, y in rows]
    lines.append(f"  {'memory':<10} {format_bytes(given['memory_bytes_per_device']):>12} "
                 f"{format_bytes(pick['memory_bytes_per_device']):>12}")
    (fast, fast_s), (slow, slow_s) = sorted([(b, pick["step_s"]), (a, given["step_s"])], key=lambda n: n[1])
    lines.append(f"{fast}'s steps are {slow_s / fast_s:.2f}x as fast as {slow}'s" if fast_s < slow_s
                 else f"{a} and {b} predict the same step")
    return "\n".join(lines)


def render(plan: Plan, layouts: int = 40, candidates: int = 20) -> str:
    """The plan as a person reads it: the fastest ``candidates`` candidates (and the choice), why the choice won,
    memory, the first ``layouts`` parameter layouts."""
    rep = plan.report
    lines = []
    if rep:
        row = (f" x {plan.seq_len} tokens" if plan.seq_len else
               f" x {plan.image_size} x {plan.image_size} images" if plan.image_size else "")
        lines.append(f"model {plan.model or '?'}, global batch {plan.global_batch}{row}, "
                     f"memory limit {format_bytes(rep['limit_bytes'])} per device")
        chosen = chosen_row(rep)
        shown = [c for k, c in enumerate(rep["candidates"]) if k < candidates or c is chosen]
        width = max(16, *(len(_brief(c)) for c in shown))
        waits = any(c.get("skew_s") for c in shown)  # ranks reaching collectives apart: a column of its own
        lines.append(f"  {'mesh':<{width}} {'step':>10} {'compute':>10} {'op comm':>10} {'dp comm':>10}"
                     + f" {'wait':>10}" * waits + f" {'memory':>11} {'gap':>6}")
        for c in shown:
            if c.get("pruned"):
                bound = f">{c['step_s'] * 1e3:.1f}ms"
                lines.append(f"  {_brief(c):<{width}} {bound:>10}   (pruned: its LP bound already loses to the choice)")
                continue
            mark = "*" if c["mesh"] == rep["chosen"] else " " if c["fits"] else "x"
            memory = ">" * c.get("memory_floor", False) + format_bytes(c["memory"]["total"])
            lines.append(f"{mark} {_brief(c):<{width}} {_ms(c['step_s'])} {_ms(c['compute_s'])} {_ms(c['op_comm_s'])} "
                         f"{_ms(c['dp_comm_s'])}" + f" {_ms(c.get('skew_s', 0.0))}" * waits
                         + f" {memory:>11} {c.get('gap', 0):>6.1%}")
        if len(shown) < len(rep["candidates"]):
            lines.append(f"  ... {len(rep['candidates']) - len(shown)} more (--candidates {len(rep['candidates'])} "
                         "lists every one)")
        lines.append(_legend(shown))
        fitting = [c for c in rep["candidates"] if c["fits"]]
        runner = next((c for c in fitting if c is not chosen), None)
        if runner:
            lines.append(f"chosen {_brief(chosen)}: {_brief(runner)} (runner-up) predicts "
                         f"{(runner['step_s'] / chosen['step_s'] - 1) * 100:.1f}% longer steps")
        if chosen.get("skew_s"):
            lines.append(f"the step waits {chosen['skew_s'] * 1e3:.1f}ms for ranks that reach its collectives apart "
                         "(the cluster's arrival skew and its gradient sync's call skew)")
        lines.append(_memory_line("memory per device" + " (the fullest pipeline rank)" * ("pipeline" in chosen),
                                  chosen["memory"], rep["limit_bytes"]))
        plain = next((c for c in rep["candidates"] if c.get("split") == chosen.get("split")
                      and (c.get("recompute"), c.get("offload", "none"), c.get("zero", 0), c.get("precision", "fp32"))
                      == ("none", "none", 0, "fp32") and ("pipeline" in c or c.get("micro_batches", 1) == 1)
                      and not c.get("pruned")), None)
        if plain is not None and plain is not chosen:
            lines.append(_memory_line("  plain (no recompute, offload, optimizer parallel, accumulation, fp32)",
                                      plain["memory"], rep["limit_bytes"]))
        if "pipeline" in chosen:
            lines.extend(_stage_table(chosen, rep["limit_bytes"]))
        if rep.get("tp_plan"):
            lines.extend(_tp_plan_lines(rep["tp_plan"]))
        if rep.get("pp_plan"):
            lines.extend(_pp_plan_lines(rep["pp_plan"]))
        if rep.get("left_whole"):
            lines.append(_left_whole_line(rep["left_whole"], plan.op_axes))
    lines.append(f"mesh: {' x '.join(f'{n}={s}' for n, s in plan.mesh) or 'one device'}; parameter layouts:")
    summary = plan.summary().splitlines()
    lines.extend(summary[:layouts])
    if len(summary) > layouts:
        lines.append(f"... {len(summary) - layouts} more (the plan file has all)")
    return "\n".join(lines)


def _legend(shown: list[dict]) -> str:
    """What the table's marks mean, those it shows."""
    marks = (("* the choice", True),
             ("x over the memory limit", any(not c["fits"] and not c.get("pruned") for c in shown)),
             ("> a lower bound, not costed further", any(c.get("pruned") or c.get("memory_floor") for c in shown)),
             ("gap: at most this much slower than the operators' fastest strategies", True))
    return "  " + "; ".join(words for words, used in marks if used)


def _stage_table(chosen: dict, limit: float) -> list[str]:
    """Per stage of a pipelined choice: its layers, seconds per micro-batch and memory; and the
    simulated bubble beside the equal-stage figure."""
    p = chosen["pipeline"]
    pp, m, v = len({s["rank"] for s in p["stages"]}), p["micro_batches"], p["virtual_stages"]
    ideal = f"(p-1)/(vm+p-1) = {pp - 1}/{v * m + pp - 1}" if v > 1 else f"(p-1)/(m+p-1) = {pp - 1}/{m + pp - 1}"
    lines = [f"pipeline: {pp} stages{f' x {v} virtual' * (v > 1)}, schedule {p['schedule']}, {m} micro-batches of "
             f"{chosen['rows'] / m:g} rows; bubble {p['bubble']:.1%} predicted, {p['ideal_bubble']:.1%} = {ideal} "
             f"for equal stages; p2p sends {chosen.get('p2p_s', 0) * 1e3:.1f}ms per step"]
    spans = [f"{s['first']}..{s['last']}" for s in p["stages"]]
    width = max(32, *map(len, spans))
    recomputes = any(s.get("recompute", "none") != "none" for s in p["stages"])
    splits = any(s.get("tp_split", "ops") != "ops" for s in p["stages"])
    lines.append(f"  {'stage':>5} {'rank':>4}  {'layers':<{width}} {'forward':>10} {'backward':>10} {'memory':>11}"
                 + "  recompute" * recomputes + "  tp splits" * splits)
    for k, (s, layers) in enumerate(zip(p["stages"], spans)):
        mark = " " if s["memory"]["total"] <= limit else "x"
        lines.append(f"{mark} {k:>5} {s['rank']:>4}  {layers:<{width}} {_ms(s['forward_s'])} {_ms(s['backward_s'])} "
                     f"{format_bytes(s['memory']['total']):>11}" + f"  {s.get('recompute'):<9}" * recomputes
                     + f"  {s.get('tp_split')}" * splits)
    if splits:
        lines.append("  (tp splits rows: the stage's tp ranks each run a share of every micro-batch's rows with the "
                     "stage's weights whole, summing their gradients)")
    return lines


def _tp_plan_lines(agreement: dict, shown: int = 5) -> list[str]:
    """How far the plan follows the model's own tensor-parallel plan, and where it departs."""
    departures = agreement["departures"]
    lines = [f"the model's tensor-parallel plan (_tp_plan): followed by {agreement['followed']} of "
             f"{agreement['modules']} modules" + ("; departs at:" if departures else "")]
    lines += [f"  {path} ({style}): {layout}" for path, style, layout in departures[:shown]]
    if len(departures) > shown:
        lines.append(f"  ... {len(departures) - shown} more")
    return lines


def _pp_plan_lines(agreement: dict) -> list[str]:
    """Whether the stage cuts fall where the model's own pipeline plan allows, and what it allows that
    the search did not consider."""
    departures, unused = agreement["departures"], agreement["not_considered"]
    lines = [f"the model's pipeline plan (_pp_plan): stages begin at {', '.join(agreement['cuts'])}"
             + (f"; {', '.join(departures)} it does not name" if departures else ", all modules it names")]
    if unused:
        lines.append(f"  it also allows cuts before {', '.join(unused)}, not considered: the search cut between "
                     "repeated blocks only (pp_plan=True, or --pp-plan, considers them)")
    return lines


def _left_whole_line(modules: list, op_axes, shown: int = 4) -> str:
    """The Linears and tables every operator rank runs whole because no dim of theirs divides, and the fix."""
    ranks = math.prod(size for _, size in op_axes)
    named = ", ".join(f"{path} ({' x '.join(map(str, shape))})" for path, shape in modules[:shown])
    more = f" and {len(modules) - shown} more" if len(modules) > shown else ""
    return (f"{named}{more} run whole on each of the {ranks} operator ranks: a split needs a dim that divides by "
            f"{ranks} (one padded to a multiple of {ranks} would do)")


def _memory_line(title: str, m: dict, limit: float) -> str:
    parts = ", ".join(f"{k} {format_bytes(m[k])}" for k in ("params", "grads", "optimizer", "activations", "buffers"))
    apart = m.get("apart", 0)
    apart = (f", less {format_bytes(apart)} of grads and activations never alive together" if apart > 0 else
             f", plus {format_bytes(-apart)} of activations' gradients alive in backward" if apart < 0 else "")
    return f"{title}: {parts}{apart} = {format_bytes(m['total'])} of {format_bytes(limit)}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:>8.1f}ms"
