"""Pipeline timelines: a schedule drawn as a PNG (a row per stage, a box per forward or backward of
a micro-batch), predicted by simulation or measured, and its bubble fraction: the share of the
stages' time spent idle, (p-1)/(m+p-1) for GPipe and 1F1B with p equal stages and m micro-batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from polyshard.errors import PolyshardError
from polyshard.schedule import ActionTime

COLORS = {"F": ("#4c72b0", "#8fb0e0"), "B": ("#55a868", "#9bd3a8")}  # per kind: even, odd chunks
LABELLED_ACTIONS = 400


def bubble_fraction(times: Sequence[ActionTime]) -> float:
    """1 - busy time / (stages x span), the span running from the first start to the last end."""
    if not times:
        raise PolyshardError("no pipeline action times to measure a bubble in")
    span = max(t.end_s for t in times) - min(t.start_s for t in times)
    busy = sum(t.end_s - t.start_s for t in times)
    return 1.0 - busy / (len({t.stage for t in times}) * span) if span > 0 else 0.0


def draw_timeline(path: str | Path, predicted: Sequence[ActionTime] | None = None,
                  measured: Sequence[ActionTime] | None = None, title: str = "") -> dict[str, float]:
    """Draw the given timelines (a panel each) into the PNG ``path``; returns each one's bubble
    fraction by name ("predicted", "measured")."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = {name: times for name, times in (("predicted", predicted), ("measured", measured)) if times}
    if not panels:
        raise PolyshardError("draw_timeline needs predicted or measured action times")
    stages = max(t.stage for times in panels.values() for t in times) + 1
    legend_in = 0.3  # a strip below the panels, so that the legend covers no box
    fig = Figure(figsize=(11, 0.6 + legend_in + (0.5 * stages + 0.9) * len(panels)))
    FigureCanvasAgg(fig)
    bubbles = {}
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)[:, 0]  # one time scale for every panel
    for ax, (name, times) in zip(axes, panels.items()):
        bubbles[name] = bubble_fraction(times)
        origin = min(t.start_s for t in times)
        sparse = len(times) <= LABELLED_ACTIONS  # boxes of long schedules are too thin for outlines and labels
        boxes: dict[int, list] = {}  # per stage (start, width), colour: one collection a stage, not one a box
        for t in times:
            start, width = (t.start_s - origin) * 1e3, (t.end_s - t.start_s) * 1e3
            boxes.setdefault(t.stage, []).append(((start, width), COLORS[t.kind][t.chunk // stages % 2]))
            if sparse:
                ax.text(start + width / 2, t.stage, f"{t.kind}{t.micro}", ha="center", va="center", fontsize=7)
        for stage, drawn in boxes.items():
            spans, colors = zip(*drawn)
            ax.broken_barh(spans, (stage - 0.4, 0.8), facecolors=colors, edgecolor="black",
                           linewidth=0.4 if sparse else 0.0)
        ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
        ax.set_ylim(stages - 0.5, -0.5)
        ax.set_xlabel("ms")
        span_ms = (max(t.end_s for t in times) - origin) * 1e3
        ax.set_title(f"{name}: {span_ms:.1f} ms, bubble {bubbles[name]:.1%}", fontsize=10)
    labelled = any(len(times) <= LABELLED_ACTIONS for times in panels.values())
    handles = [Patch(facecolor=COLORS["F"][0], label="forward" + " (F3: micro-batch 3's)" * labelled),
               Patch(facecolor=COLORS["B"][0], label="backward" + " (B3)" * labelled)]
    if any(t.chunk >= stages for times in panels.values() for t in times):  # interleaved: a rank's chunks alternate
        handles.append(Patch(facecolor=COLORS["F"][1], label="a rank's next virtual stage (lighter)"))
    fig.legend(handles=handles, loc="lower center", fontsize=7, ncol=len(handles), frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    return bubbles
