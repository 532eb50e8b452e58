"""PNG plots of the scenarios (matplotlib, Agg backend). Every function takes the scenario's result dict and a
path; a missing matplotlib only skips the plot."""

from __future__ import annotations

import math


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the bench extra
        return None
    return plt


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _clean(v):
    return 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else v


def bars(path: str, title: str, panels: list[tuple[str, list[str], list[float]]]):
    """One bar chart per panel: (y label, bar labels, values)."""
    plt = _plt()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (ylabel, labels, values) in zip(axes[0], panels):
        values = [_clean(v) for v in values]
        pos = range(len(labels))
        ax.bar(pos, values, color=[f"C{i % 10}" for i in pos])
        ax.set_xticks(list(pos))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        for x, v in zip(pos, values):
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    return _save(fig, path)


def lines(path: str, title: str, panels: list[tuple[str, str, dict[str, tuple[list, list]]]], *, logx=False):
    """One line chart per panel: (x label, y label, {series: (xs, ys)})."""
    plt = _plt()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (xlabel, ylabel, series) in zip(axes[0], panels):
        for name, (xs, ys) in series.items():
            ax.plot(xs, [_clean(y) for y in ys], marker="o", label=name)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)
