"""A bench result as a picture (matplotlib, drawn off-screen with the Agg canvas): speed-up over
``ar`` per Spec-Bench category and overall for every row, peers included (hatched), and τ, the
mean tokens per target call, where a row reports it."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .report import CATEGORY_ORDER, by_category, machine_line, peer_rows, row_label


def _matplotlib():
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'speculant[plot]' (or pip install "
                          "matplotlib)") from None
    return Figure, FigureCanvasAgg, colormaps


def check_plot_path(path: str | Path) -> None:
    """Fail early (before a bench runs) if the plot cannot be drawn or written to ``path``."""
    _matplotlib()
    p = Path(path)
    if not p.parent.is_dir():
        raise ConfigError(f"cannot write the plot {p}: no directory {p.parent}/ (create it or pick another path)")
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = p.suffix.lstrip(".").lower()
    if fmt not in FigureCanvasBase.get_supported_filetypes():
        raise ConfigError(f"cannot write the plot {p}: unknown image type {p.suffix or '(no suffix)'!r}; "
                          "end the name in .png (or .svg, .pdf)")


def plot_result(result: dict, path: str | Path) -> Path:
    """Draw ``result`` (a bench JSON's content) to the image file ``path`` (PNG, or any format
    matplotlib writes by its suffix); return the path."""
    Figure, FigureCanvasAgg, colormaps = _matplotlib()
    path = Path(path)
    summary = result["summary"]
    methods = list(summary)
    peers = set(peer_rows(result))
    per_cat = by_category(result)
    cats = [c for c in CATEGORY_ORDER if c in per_cat.get("ar", {})]
    cats += sorted(set(per_cat.get("ar", {})) - set(cats))
    groups = [*cats, "all"]

    def speedup(m: str, c: str) -> float:
        if c == "all":
            return summary[m].get("speedup") or 0.0
        base = per_cat["ar"].get(c)
        return per_cat[m].get(c, 0.0) / base if base else 0.0

    fig = Figure(figsize=(max(12.0, 1.2 * len(groups) + 0.45 * len(methods) + 3), 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, height_ratios=(3, 2))

    cmap = colormaps["tab20" if len(methods) > 10 else "tab10"]
    colors = [cmap(i % cmap.N) for i in range(len(methods))]
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        top.bar(xs, [speedup(m, c) for c in groups], width,
                label=row_label(result, m) + (" (peer)" if m in peers else ""),
                color=colors[i], hatch="//" if m in peers else None, edgecolor="white" if m in peers else None,
                linewidth=0)
    top.axhline(1.0, color="black", linewidth=0.8)
    top.set_xticks(range(len(groups)), [g.replace("_", " ") for g in groups])
    top.set_ylabel("speed-up over ar (tok/s, prefill included)")
    fig.legend(loc="outside right upper", fontsize="small")
    top.grid(axis="y", alpha=0.3)

    taus = [summary[m].get("tokens_per_call") or 0.0 for m in methods]
    bars = bottom.bar(range(len(methods)), taus, color=colors)
    for b, t, m in zip(bars, taus, methods):
        if m in peers:
            b.set_hatch("//")
            b.set_edgecolor("white")
        bottom.annotate(f"{t:.2f}" if t else "n/a", (b.get_x() + b.get_width() / 2, t), ha="center",
                        va="bottom", fontsize="small", xytext=(0, 2), textcoords="offset points")
    bottom.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    bottom.set_ylim(0, max([*taus, 1.0]) * 1.15)
    bottom.set_ylabel("τ (tokens per target call)")
    bottom.grid(axis="y", alpha=0.3)

    cfg = result.get("config") or {}
    date = str(result.get("date") or "")[:10]
    fig.suptitle(f"speculant bench: {cfg.get('target', '?')} on {machine_line(result)}"
                 + (f", {date}" if date else ""), fontsize="medium")
    try:
        fig.savefig(path, dpi=110)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot write the plot {path}: {e}") from None
    return path
