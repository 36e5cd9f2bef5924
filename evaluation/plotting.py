"""What every plot of the harness shares: one colour per press, and one legend below the panels.

Used by the report (:mod:`evaluation.report`) and the speed benchmark's plots
(:mod:`evaluation.studies.bench_speed_memory.report`), so a grid of 20-odd presses reads the same in both.
"""

from __future__ import annotations


def press_colors(presses: list[str], baseline: str | None = None) -> dict[str, tuple]:
    """One colour (an RGB tuple) per press but ``baseline`` (drawn apart, e.g. as a dashed line), fixed by its place
    in ``presses``: tab10 for up to 10 presses, else tab20 then tab20b (40 colours; past 40 they repeat)."""
    import matplotlib

    others = [p for p in presses if p != baseline]
    names = ["tab10"] if len(others) <= 10 else ["tab20", "tab20b"]
    palette = [color for name in names for color in matplotlib.colormaps[name].colors]
    return {p: palette[i % len(palette)] for i, p in enumerate(others)}


def legend_below(fig, *axes) -> None:
    """One legend for ``fig``, of the labelled artists of ``axes`` (each label once, the first axes' first), below
    its panels (``fig`` must use the ``constrained`` layout), in as many columns as the figure's width holds for its
    longest label (at 7 points a character takes ~4 points of width, and a column's marker and gaps ~32 more); the
    figure grows by the legend's height (~10 points a row), so its panels keep their size; none when nothing is
    labelled."""
    seen: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if not seen:  # nothing labelled: no empty legend box
        return
    labels, handles = list(seen), list(seen.values())
    column = (4 * max(len(label) for label in labels) + 32) / 72  # inches
    ncol = max(1, min(int(0.95 * fig.get_figwidth() // column), len(labels)))
    rows = -(-len(labels) // ncol)
    fig.set_figheight(fig.get_figheight() + (10 * rows + 16) / 72)
    fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=7)


def name_points(ax, points: list[tuple[float, float]], names: list[str], fontsize: float = 6) -> None:
    """Name each point of ``points`` (data coordinates ``(x, y)``, one name each) on ``ax``, beside it, no two names
    on one line: the names go from the highest point down, each moved below the one above by a line's height
    (``fontsize`` + 2 points) where it would overlap it, with a thin line to its point when moved; to the right of a
    point in the panel's left 60 %, to the left of the others; a stack that runs below the panel is lifted into it.
    Call it once everything else is on ``ax``: it reads ``ax``'s final limits (log axes too). Points of a quality-cost
    frontier crowd near a cost of 1, where five names once printed over one another."""
    if not points:
        return
    ax.get_xlim(), ax.get_ylim()  # settles the autoscaled limits the positions below are taken from
    fractions = (ax.transScale + ax.transLimits).transform(points)  # data -> fraction of the axes
    line = (fontsize + 2) / (ax.get_position().height * ax.figure.get_figheight() * 72)  # a line, in axes fractions
    order = sorted(range(len(points)), key=lambda i: -fractions[i][1])
    heights, above = {}, float("inf")
    for i in order:
        heights[i] = above = min(fractions[i][1], above - line)
    lift = max(0.0, line / 2 - min(heights.values()))
    for i in order:
        x, y = fractions[i][0], heights[i] + lift
        right = x <= 0.6
        moved = abs(y - fractions[i][1]) > line / 2
        ax.annotate(
            names[i],
            points[i],
            xytext=(x + (0.02 if right else -0.02), y),
            textcoords="axes fraction",
            ha="left" if right else "right",
            va="center",
            fontsize=fontsize,
            arrowprops={"arrowstyle": "-", "linewidth": 0.5, "color": "0.5"} if moved else None,
        )
