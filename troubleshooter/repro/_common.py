"""Shared plumbing of the reproductions: running a child Python, reading its JSON, small plots.

Why children: a reproduction provokes real failures (an address-space limit, a process group,
DeepSpeed's CPU accelerator) that must not leak into the caller, which is usually a notebook
kernel or the test runner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from troubleshooter.notebook_css import scoped

REPO = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a reproduction's child: one thread per process (2 ranks on 2 cores must
    not oversubscribe), the repository importable, warnings that fire on every step silenced."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


class ChildError(RuntimeError):
    """A reproduction's child process failed in a way the reproduction did not expect."""


def run_child(argv: list[str], *, timeout: float, env: dict[str, str] | None = None) -> tuple[list[dict], str]:
    """Run ``python argv...``; return the JSON objects it printed (one per line) and its stderr."""
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env or child_env(), cwd=str(REPO), stdin=subprocess.DEVNULL)
    records = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    if proc.returncode != 0:
        raise ChildError(f"{' '.join(argv[:3])} exited {proc.returncode}:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return records, proc.stderr


def html_table(header: list[str], rows: list[list[Any]]) -> str:
    """A small HTML table for a result's ``_repr_html_``, left-aligned in our own scoped style."""
    import html

    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return scoped(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def new_figure(width: float = 6.0, height: float = 3.2):
    """A matplotlib Figure that is not registered with pyplot (no global state, no GUI), and that
    a notebook shows as an image: a figure built without pyplot has no display hook, so a plain
    ``Figure`` prints as ``<Figure size 650x340 with 1 Axes>``; this one has ``_repr_png_``."""
    return _inline_figure_class()(figsize=(width, height), layout="constrained")


@lru_cache(maxsize=1)
def _inline_figure_class() -> type:
    from matplotlib.figure import Figure

    from troubleshooter.notebook_css import figure_png

    class InlineFigure(Figure):
        """A Figure that IPython displays as PNG."""

        def _repr_png_(self) -> bytes:
            return figure_png(self)

    return InlineFigure
