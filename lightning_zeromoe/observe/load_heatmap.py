"""The load picture: a per-layer x per-expert heatmap of each monitor window, and where it is logged.

Each cell is the expert's share of the layer's tokens relative to uniform routing
(``share / (top_k / num_experts)``): 1 is an even load, 0 a dead expert, ``num_experts / top_k``
an expert that every token picks. The colour scale is centred on 1 (white), over-loaded experts
red, under-loaded blue.

Where a window's heatmap goes, per logger of the Trainer:

* ``TensorBoardLogger``: an image (``SummaryWriter.add_image``) under ``<prefix>/load_heatmap``, one
  per window, so TensorBoard's step slider plays the load over time;
* a logger with a ``log_image(key, images, step)`` method (Lightning's ``WandbLogger``): that method;
* ``CSVLogger``, which cannot hold images, and any other logger: a PNG file per window,
  ``<log_dir>/expert_load/step_<step>.png`` next to the logger's files (its ``metrics.csv``); the
  monitor says so once, with the directory.

matplotlib draws the figures (Agg, without pyplot); it is needed only when heatmaps are asked for.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from lightning_zeromoe.observe.monitor import LayerStats

__all__ = ["history_figure", "load_heatmap", "load_matrix", "log_heatmap", "require_matplotlib"]

#: Annotate cells with the share when a layer has at most this many experts.
ANNOTATE_UP_TO = 16


def require_matplotlib() -> None:
    """Raise an ImportError that says what heatmaps need, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError("ExpertUtilizationMonitor(heatmap=True) draws the heatmaps with matplotlib, which is "
                          "not installed: pip install matplotlib") from err


def load_matrix(stats: Mapping[str, "LayerStats"], top_k: int) -> tuple[list[str], list[list[float]]]:
    """Layers (rows) and each expert's load relative to uniform; NaN pads layers with fewer experts."""
    layers = list(stats)
    width = max((len(s.shares) for s in stats.values()), default=0)
    rows = []
    for layer in layers:
        shares = stats[layer].shares
        uniform = top_k / len(shares)
        rows.append([share / uniform for share in shares] + [math.nan] * (width - len(shares)))
    return layers, rows


@lru_cache(maxsize=1)
def _figure_class() -> type:
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    class LoadFigure(Figure):
        """A Figure that is not registered with pyplot and that a notebook shows as PNG."""

        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            FigureCanvasAgg(self).print_png(buffer)
            return buffer.getvalue()

    return LoadFigure


def _short(layer: str) -> str:
    """``model.layers.12.mlp`` -> ``layers.12.mlp`` (row labels stay readable)."""
    parts = layer.split(".")
    return ".".join(parts[-3:]) if len(parts) > 3 else layer


def _norm(vmax: float) -> Any:
    from matplotlib.colors import TwoSlopeNorm

    return TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, vmax))


def load_heatmap(stats: Mapping[str, "LayerStats"], top_k: int, step: int, steps_per_window: int | None = None) -> Any:
    """One window's heatmap: a row per MoE layer, a column per expert, colour = load / uniform."""
    import numpy as np

    layers, rows = load_matrix(stats, top_k)
    data = np.array(rows, dtype=float) if rows else np.zeros((0, 0))
    width = data.shape[1] if data.size else 1
    fig = _figure_class()(figsize=(min(14.0, 2.2 + 0.45 * width), 1.4 + 0.32 * max(1, len(layers))),
                          layout="constrained")
    ax = fig.subplots()
    peak = float(np.nanmax(data)) if data.size else 2.0
    image = ax.imshow(data, cmap="RdBu_r", norm=_norm(peak), aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(layers)), [_short(l) for l in layers], fontsize=7)
    ax.set_xticks(range(width), [str(e) for e in range(width)], fontsize=7)
    ax.set_xlabel("expert")
    window = f" ({steps_per_window} steps)" if steps_per_window else ""
    ax.set_title(f"Expert load / uniform, window ending at step {step}{window}", fontsize=9)
    if width <= ANNOTATE_UP_TO:
        for (i, j), value in np.ndenumerate(data):
            if not math.isnan(value):
                ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=6,
                        color="white" if abs(value - 1) > 0.6 * max(1.0, peak - 1) else "black")
    fig.colorbar(image, ax=ax, shrink=0.8, label="load / uniform")
    return fig


def history_figure(history: Sequence[tuple[int, Mapping[str, "LayerStats"]]], top_k: int) -> Any:
    """The load over time: one panel per layer, window (x) by expert (y), colour = load / uniform."""
    import numpy as np

    layers = list(dict.fromkeys(layer for _, stats in history for layer in stats))
    fig = _figure_class()(figsize=(9.0, 0.6 + 1.8 * max(1, len(layers))), layout="constrained")
    axes = fig.subplots(max(1, len(layers)), 1, squeeze=False)[:, 0]
    steps = [step for step, _ in history]
    peak = 2.0
    images = []
    for ax, layer in zip(axes, layers):
        columns = []
        for _, stats in history:
            s = stats.get(layer)
            columns.append([x / (top_k / len(s.shares)) for x in s.shares] if s else [])
        height = max((len(c) for c in columns), default=0)
        data = np.full((height, len(columns)), np.nan)
        for j, column in enumerate(columns):
            data[: len(column), j] = column
        peak = max(peak, float(np.nanmax(data)) if data.size else 0.0)
        images.append((ax, data))
        ax.set_ylabel(f"{_short(layer)}\nexpert", fontsize=7)
    mappable = None
    for ax, data in images:
        mappable = ax.imshow(data, cmap="RdBu_r", norm=_norm(peak), aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=6)
    if layers:
        axes[-1].set_xlabel("step (end of window)")
        axes[0].set_title("Expert load / uniform, window by window", fontsize=9)
        fig.colorbar(mappable, ax=list(axes), shrink=0.8, label="load / uniform")
    return fig


def _rgb(fig: Any) -> Any:
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _png_dir(logger: Any, trainer: Any) -> Path:
    base = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None) or trainer.default_root_dir
    return Path(base) / "expert_load"


def log_heatmap(trainer: Any, fig: Any, step: int, tag: str) -> list[str]:
    """Hand one heatmap to every logger of ``trainer`` (see the module docstring); return, per logger
    that got a PNG file instead of an image, a line saying where (``[]`` when all took images)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    notes = []
    rgb = None
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            rgb = _rgb(fig) if rgb is None else rgb
            logger.experiment.add_image(tag, rgb, global_step=step, dataformats="HWC")
        elif callable(getattr(logger, "log_image", None)):
            rgb = _rgb(fig) if rgb is None else rgb
            logger.log_image(key=tag, images=[rgb], step=step)
        else:
            folder = _png_dir(logger, trainer)
            folder.mkdir(parents=True, exist_ok=True)
            fig.savefig(folder / f"step_{step:06d}.png", dpi=110)
            notes.append(f"{type(logger).__name__} takes no images: the expert-load heatmaps are PNG files in {folder}")
    return notes
