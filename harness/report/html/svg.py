"""Plots as inline SVG: matplotlib figures drawn without pyplot (no global state, no display), and
long series thinned for drawing so that a timeline of half a million actions stays a small image."""

from __future__ import annotations

import io
import itertools
import re
from dataclasses import dataclass

import numpy as np

GIB = 2**30
# the most points a line keeps: each bucket of a longer series keeps its lowest and its highest point,
# so every peak and every trough a reader could see survives
DRAW_BUCKETS = 1500
COLORS = {"allocated": "#1f77b4", "reserved": "#ff7f0e", "device": "#2ca02c", "predicted": "#d62728",
          "card": "#444444", "budget": "#d62728"}


@dataclass(frozen=True)
class Figure:
    """One plot of the page: its SVG markup (without the XML prolog) and the caption under it."""

    key: str  # unique on the page; also seeds the SVG's internal ids, so that figures never share one
    svg: str
    caption: str


def new_figure(width: float, height: float):
    """A matplotlib Figure of `width` x `height` inches, drawn by the SVG backend."""
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(width, height), layout="constrained")
    FigureCanvasSVG(fig)
    return fig


def shared_legend(fig, axes, ncols: int) -> None:
    """One legend below every subplot of `fig`, each label once (subplots draw the same series)."""
    handles, labels = [], []
    for ax in axes.flat:
        for h, la in zip(*ax.get_legend_handles_labels(), strict=True):
            if la not in labels:
                handles.append(h)
                labels.append(la)
    fig.legend(handles, labels, fontsize=7, loc="outside lower center", ncols=ncols)


def to_svg(fig, key: str) -> str:
    """The figure as SVG markup to inline in HTML: text kept as text (small, searchable), ids unique
    to this figure, no date in the metadata (the same inputs give the same page)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"oom-harness-{key}"}):
        # lay the figure out once and keep that layout: left on, the engine would be run again in the
        # layout pass savefig makes before it draws and once more in the drawing itself, twice the cost
        # (most of the report's time) for the same positions
        engine = fig.get_layout_engine()
        if engine is not None:
            engine.execute(fig)
            fig.set_layout_engine(None)
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    # scale with the page: the width and height attributes become the view box's aspect only
    return re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r'<svg\1 class="plot"', text, count=1)


def thinned(x, y, buckets: int = DRAW_BUCKETS) -> tuple[np.ndarray, np.ndarray]:
    """`x`, `y` with at most 2 x `buckets` points: each bucket of consecutive points keeps its lowest and
    highest, in order. Shorter series come back whole."""
    x, y = np.asarray(x), np.asarray(y)
    n = len(y)
    if n <= 2 * buckets:
        return x, y
    edges = np.linspace(0, n, buckets + 1).astype(int)
    keep = []
    for a, b in itertools.pairwise(edges):
        seg = y[a:b]
        lo, hi = a + int(np.argmin(seg)), a + int(np.argmax(seg))
        keep += [lo, hi] if lo <= hi else [hi, lo]
    idx = np.unique(np.array(keep))
    return x[idx], y[idx]


def gib(value) -> float | None:
    return None if value is None else value / GIB
