"""What every plot shares: a figure without ``pyplot``, qualitative colours, curve styles."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import matplotlib
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

#: Line styles that, crossed with the 10 colours of ``tab10``, tell 40 curves apart.
LINESTYLES: tuple[str, ...] = ("-", "--", "-.", ":")


def listed_colours(name: str) -> Sequence[Any]:
    """The colours of matplotlib's qualitative colormap ``name`` (a ``ListedColormap``)."""
    cmap = matplotlib.colormaps[name]
    if not isinstance(cmap, ListedColormap):
        raise TypeError(f"colormap {name!r} is not a ListedColormap")
    return cast(Sequence[Any], cmap.colors)  # the qualitative maps list RGB tuples


def curve_style(k: int) -> dict[str, Any]:
    """Colour and line style of the ``k``-th curve: 10 colours, then the next line style, so
    the first 40 curves all differ (matplotlib's default cycle repeats after 10)."""
    colours = listed_colours("tab10")
    return {"color": colours[k % 10], "linestyle": LINESTYLES[(k // 10) % len(LINESTYLES)]}


def fig_ax(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """``ax`` and its root figure, or a new figure (no ``pyplot``) of ``figsize`` and its axes."""
    if ax is not None:
        fig = ax.figure
        while not isinstance(fig, Figure):  # an axes of a SubFigure: its root Figure
            fig = fig.figure
        return fig, ax
    fig = Figure(figsize=figsize)
    return fig, fig.subplots()


__all__ = ["LINESTYLES", "curve_style", "fig_ax", "listed_colours"]
