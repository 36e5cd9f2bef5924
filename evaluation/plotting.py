"""What every plot of the harness shares: one colour per press, and one legend below the panels; for the report, at
most ten presses in colour per panel (tab10, with markers and line styles past ten) and titles that fit their figure.

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


#: At most this many presses are drawn in colour in one panel: more are split into panels of their own (a plot of one
#: panel) or drawn grey behind the leading ones (plots that already have a panel per task or length).
MAX_LINES = 10

_MARKERS = ("o", "s", "^", "D")
_LINESTYLES = ("-", "--", ":", "-.")


def press_styles(presses: list[str], baseline: str | None = None) -> dict[str, dict]:
    """One line style (``color``, ``marker``, ``linestyle``: keyword arguments of ``Axes.plot``) per press but
    ``baseline``, fixed by its place ``i`` in ``presses``: tab10's colour ``i % 10``, and the marker and line style of
    ``i // 10``; so any ten presses in a row have ten colours (a panel of :func:`press_groups`), and no two of 40
    presses share both colour and marker (past 40 they repeat)."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"].colors
    others = [p for p in presses if p != baseline]
    return {
        p: {
            "color": palette[i % 10],
            "marker": _MARKERS[(i // 10) % len(_MARKERS)],
            "linestyle": _LINESTYLES[(i // 10) % len(_LINESTYLES)],
        }
        for i, p in enumerate(others)
    }


def press_groups(presses: list[str], baseline: str | None = None, size: int = MAX_LINES) -> list[list[str]]:
    """The presses but ``baseline``, in their order, cut into as few runs of consecutive presses as hold at most
    ``size`` each, as even as possible (22 presses: 8, 7, 7); one group when they fit in one."""
    others = [p for p in presses if p != baseline]
    n = max(1, -(-len(others) // size))
    cuts = [round(k * len(others) / n) for k in range(n + 1)]
    return [others[a:b] for a, b in zip(cuts, cuts[1:])]


def fit_title(text: str, width: float, fontsize: float = 12) -> str:
    """``text`` wrapped at spaces into lines that fit ``width`` inches at ``fontsize`` points (a character of
    matplotlib's default font takes ~0.62 of the size on average), so a title wider than its figure is not cut."""
    import textwrap

    return "\n".join(textwrap.wrap(text, max(10, int(width * 72 / (0.62 * fontsize))), break_on_hyphens=False))
